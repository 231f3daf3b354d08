// Locret-Q for tools: the layout of a prompt with its query, and which leading tokens hold the query (the part to
// pin). The same rule as
// py/locret/query.py's pinned_count, so that the tools and the Python API pin the same tokens.

#include "llama-locret.h"

#include "locret-heads.h"

#include "llama-impl.h"

#include <cstring>
#include <string>

int32_t llama_locret_query_layout(const char * query, const char * text, char * out, int32_t n_out) {
    // the query without surrounding white space (a query file's last line end would otherwise widen the separator)
    std::string q = query != nullptr ? query : "";
    const size_t first = q.find_first_not_of(" \t\r\n");
    q = first == std::string::npos ? "" : q.substr(first, q.find_last_not_of(" \t\r\n") - first + 1);
    const std::string placed = q + LLAMA_LOCRET_QUERY_SEPARATOR + (text != nullptr ? text : "");
    if (out != nullptr && n_out > 0) {
        const size_t n = std::min(placed.size(), (size_t) n_out - 1);
        std::memcpy(out, placed.data(), n);
        out[n] = '\0';
    }
    return (int32_t) placed.size();
}

int32_t llama_locret_query_tokens(const llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
        const char * query, int32_t limit) {
    locret_set_error("");
    // the query as placed: without surrounding white space
    std::string needle = query != nullptr ? query : "";
    const size_t first = needle.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) {
        locret_set_error("the Locret-Q query is empty");
        return -1;
    }
    needle = needle.substr(first, needle.find_last_not_of(" \t\r\n") - first + 1);

    const int32_t n = std::min(n_tokens, limit);
    std::string text;
    char buf[256];
    for (int32_t i = 0; i < n; ++i) {
        const int32_t len = llama_token_to_piece(vocab, tokens[i], buf, sizeof(buf), 0, false);
        if (len < 0) {
            locret_set_error(format("token %d has a piece longer than %zu bytes", tokens[i], sizeof(buf)));
            return -1;
        }
        text.append(buf, (size_t) len);
        // a first occurrence ends inside this token's piece
        const size_t from = text.size() > needle.size() + (size_t) len ? text.size() - needle.size() - (size_t) len : 0;
        if (text.find(needle, from) != std::string::npos) {
            return i + 1;
        }
    }
    locret_set_error(format("the Locret-Q query is not within the first %d tokens of the prompt (it must be placed at "
            "the start, and fit in the budget)", n));
    return -1;
}
