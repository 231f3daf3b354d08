// main() of the replay builds of the coverage-guided fuzz targets (lf-*.cpp): runs LLVMFuzzerInitialize, then
// LLVMFuzzerTestOneInput once on every file of the folders and files given (a corpus: the seeds, and every input a
// fuzzing campaign found a crash with, kept as a regression input). A finding aborts, so ctest fails; without
// libFuzzer, this runs in the normal build. Prints how many inputs ran.
//
//   replay-locret-heads DIR_OR_FILE...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int * argc, char *** argv);
extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s DIR_OR_FILE...\n", argv[0]);
        return 2;
    }
    LLVMFuzzerInitialize(&argc, &argv);
    std::vector<std::filesystem::path> inputs;
    for (int i = 1; i < argc; ++i) {
        const std::filesystem::path p = argv[i];
        std::error_code ec;
        if (std::filesystem::is_directory(p, ec)) {
            for (const auto & e : std::filesystem::directory_iterator(p)) {
                if (e.is_regular_file() && e.path().filename().string()[0] != '.') {
                    inputs.push_back(e.path());
                }
            }
        } else if (std::filesystem::is_regular_file(p, ec)) {
            inputs.push_back(p);
        } else {
            std::fprintf(stderr, "%s: %s is neither a file nor a folder\n", argv[0], argv[i]);
            return 2;
        }
    }
    if (inputs.empty()) {
        std::fprintf(stderr, "%s: no inputs in the folders given\n", argv[0]);
        return 2;
    }
    std::sort(inputs.begin(), inputs.end());
    for (const auto & p : inputs) {
        std::ifstream f(p, std::ios::binary);
        const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    }
    std::printf("%s: %zu inputs replayed, no finding\n", argv[0], inputs.size());
    return 0;
}
