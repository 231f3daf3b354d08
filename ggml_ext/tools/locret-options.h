// The Locret options of the llama.cpp tools, written once: common's parser (llama-cli, llama-completion, llama-server)
// and llama-bench's own parser both read this table, so adding an option is one row here and needs no patch.
// Compiled into llama-common by tools.cmake (included from common/CMakeLists.txt by a hook patch).
#pragma once

#include "llama-locret.h"

#include <cstddef>
#include <cstdint>
#include <string>

// what the options set; common_params and llama-bench's cmd_params each hold one
struct locret_options {
    std::string heads;                          // --locret-heads (empty: the model's embedded heads, if any)
    int32_t     budget      = -1;               // --locret-budget (-1: not given, no eviction)
    double      budget_mib  = -1;               // --locret-budget-mib (-1: not given): resolved into `budget` before
                                                // the model is loaded (locret_options_resolve_mib)
    int32_t     stabilizers = -1;               // -1: the heads file's value, fitted to the ubatch
    int32_t     local       = -1;               // -1: the heads file's value, fitted to the ubatch
    llama_locret_policy policy = LLAMA_LOCRET_POLICY_HEADS;
    int32_t     pool        = -1;               // -1: none
    std::string policy_settings;                // --locret-policy NAME:SETTINGS (empty: the policy's defaults)
    std::string budget_schedule;                // empty: uniform
    // the draft model's own bounded cache (-md with --spec-type draft-simple): its budget (-1: --locret-budget), its
    // policy (-1: heads when it has heads, else streaming) and heads (empty: the ones embedded in the draft model)
    int32_t     draft_budget = -1;
    int32_t     draft_policy = -1;
    std::string draft_heads;
    int32_t     positions      = -1;            // --locret-positions (-1: the library's default)
    int32_t     position_limit = -1;            // keep:N (-1: the model's trained context)
    std::string query;                          // Locret-Q: placed at the prompt's start and pinned
    bool        query_auto  = false;            // --locret-query auto: the question found in the prompt instead
    bool        query_off   = false;            // --locret-query off: no query, whatever the heads recommend
    // --locret-requery on|off (llama-server, chats with auto): on, each request pins the question that closes its last
    // user message, so a follow-up re-reads the conversation for it; off, the conversation's first question stays
    // pinned and a follow-up reads only what is new (answered from what the first question's eviction kept)
    bool        requery     = true;
    // set when the model is configured (locret_common_configure): auto is in effect (asked for, or the default of
    // Locret-Q heads without a query given, with eviction); and the question the tool then found in its prompt
    mutable bool        query_auto_on = false;
    mutable std::string query_found;
    // the model's vocabulary (set with the above): a completion prompt's chat template markers are its control tokens
    mutable const llama_vocab * vocab = nullptr;

    // the settings as the library takes them (budget_schedule points into this object)
    llama_locret_params params() const;

    // a budget was asked for, in units or in MiB (before locret_options_resolve_mib has run)
    bool evicting() const { return budget >= 0 || budget_mib > 0; }
};

struct locret_option {
    const char * name;       // e.g. "--locret-budget"
    const char * value_hint; // e.g. "N"
    const char * env;        // the environment variable common reads it from
    const char * help;       // may span lines ('\n'); common prints it as is, llama-bench indents it
    // parses `value` into `o`; throws std::invalid_argument with the reason
    void (*set)(locret_options & o, const std::string & value);
};

size_t                locret_option_count();
const locret_option & locret_option_at(size_t i);

// the option named `name`, or NULL
const locret_option * locret_option_find(const std::string & name);

// Registers the options' heads and settings for the contexts created next from `model`, as every tool does: heads from
// --locret-heads, else the ones embedded in model_path (only for a policy that needs them). *heads gets the heads loaded
// (free them after those contexts). Returns "" or the reason it failed (nothing stays registered then).
std::string locret_options_configure(const locret_options & o, llama_model * model, const std::string & model_path,
                                     llama_locret_heads ** heads);

// --locret-budget-mib: sets o.budget to the largest budget whose memory per sequence fits o.budget_mib for this model
// and the context parameters' K/V types and ubatch (llama_locret_budget_for_mib), and *resolved to one line saying so
// for the start-up log. Returns "" (also when no MiB was given) or the reason it cannot (both options given, too
// small: the message names the smallest size that works, ...).
std::string locret_options_resolve_mib(locret_options & o, const std::string & model_path,
                                       const llama_context_params & cparams, std::string * resolved);

// Locret-Q's layout (llama_locret_query_layout): the query, a blank line, then the text
std::string locret_query_layout(const std::string & query, const std::string & text);

// Locret-Q auto (llama_locret_find_question): the question at the end of `text`, or ""
std::string locret_find_question(const std::string & text);

// The same two for a completion prompt, which may hold a chat template written out (llama_locret_prompt_layout,
// llama_locret_find_prompt_question): the query opens the first user turn's text, the question is the last user turn's
std::string locret_prompt_layout(const llama_vocab * vocab, const std::string & query, const std::string & prompt);
std::string locret_find_prompt_question(const llama_vocab * vocab, const std::string & prompt);

// what a tool adds to "failed to create context": ": " and the library's reason when Locret refused the context, else ""
std::string locret_error_suffix();
