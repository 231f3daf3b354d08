# Compiles the Locret doors of the llama.cpp tools (ggml_ext/tools/) into llama-common.
#
# Included from llama.cpp's common/CMakeLists.txt by a hook patch, after the llama-common target exists. The option
# table, the refusals and the tools' sizing live here, so that adding an option needs no patch.

set(LOCRET_TOOLS_SOURCES
    ${CMAKE_CURRENT_LIST_DIR}/tools/locret-options.cpp
    ${CMAKE_CURRENT_LIST_DIR}/tools/locret-common.cpp
    ${CMAKE_CURRENT_LIST_DIR}/tools/locret-bench.cpp
    ${CMAKE_CURRENT_LIST_DIR}/tools/locret-server.cpp
)

target_sources(llama-common PRIVATE ${LOCRET_TOOLS_SOURCES})
target_include_directories(llama-common PUBLIC ${CMAKE_CURRENT_LIST_DIR}/tools)

if (LOCRET_COVERAGE)
    set_property(SOURCE ${LOCRET_TOOLS_SOURCES} APPEND PROPERTY COMPILE_OPTIONS --coverage)
    target_link_options(llama-common PRIVATE --coverage)
endif()
