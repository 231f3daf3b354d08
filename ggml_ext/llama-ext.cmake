# Compiles the Locret extension into the `llama` target.
#
# Included from llama.cpp's src/CMakeLists.txt by the hook patch
# patches/0001-build-compile-the-Locret-extension-into-libllama.patch, after the target exists.
# The parent project (our top-level CMakeLists.txt) sets LOCRET_GGML_EXT_DIR, LOCRET_VERSION and
# LOCRET_PATCH_SERIES; a plain llama.cpp build never includes this file.

if (NOT LOCRET_VERSION OR NOT LOCRET_PATCH_SERIES)
    message(FATAL_ERROR "locret: LOCRET_VERSION and LOCRET_PATCH_SERIES must be set by the parent project")
endif()

set(LOCRET_EXT_SOURCES
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-version.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-heads.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-graph.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-context.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-settings.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-size.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-policy.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-lagkv.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-sage.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-layer-mask.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-select.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-workers.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-cells.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-groups.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-stores.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-layout.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-compact.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-plan.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-memory.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-evictor.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-state.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-kv-state.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-debug.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/locret-query.cpp
)

# one file per policy (locret-policy.h): a new policy's file is compiled without a line here
file(GLOB LOCRET_POLICY_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/src/locret-policy-*.cpp)
list(SORT LOCRET_POLICY_SOURCES)
list(APPEND LOCRET_EXT_SOURCES ${LOCRET_POLICY_SOURCES})

configure_file(${CMAKE_CURRENT_LIST_DIR}/src/locret-build-config.h.in
               ${CMAKE_CURRENT_BINARY_DIR}/locret/locret-build-config.h @ONLY)

target_sources(llama PRIVATE ${LOCRET_EXT_SOURCES})
# our sources are few and include llama.cpp internals; keep them out of the unity batches
set_source_files_properties(${LOCRET_EXT_SOURCES} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
# ggml_ext/src holds locret-hooks.h, which the hook patches include from llama.cpp's sources
target_include_directories(llama PRIVATE ${CMAKE_CURRENT_BINARY_DIR}/locret ${CMAKE_CURRENT_LIST_DIR}/src)
target_include_directories(llama PUBLIC  ${CMAKE_CURRENT_LIST_DIR}/include)

# line coverage of our sources only (scripts/coverage.sh): llama.cpp's own stay uninstrumented, so that the model runs at
# its usual speed
if (LOCRET_COVERAGE)
    set_property(SOURCE ${LOCRET_EXT_SOURCES} APPEND PROPERTY COMPILE_OPTIONS --coverage)
    target_link_options(llama PRIVATE --coverage)
endif()
