// The doors through which llama.cpp's common library (llama-cli, llama-completion, llama-server) reaches Locret: the
// options, the checks before the memory is planned, the configuration before the context is created, and Locret-Q's
// pin. The hook patches call these; everything they decide lives here and in libllama's rule book.
#pragma once

#include "locret-options.h"
#include "llama-locret.h"

#include <memory>
#include <vector>

struct common_arg;
struct common_params;
struct llama_context;
struct llama_context_params;
struct llama_model;

// the heads a tool loaded for a context, freed with their owner
using locret_heads_ptr = std::unique_ptr<llama_locret_heads, decltype(&llama_locret_heads_free)>;

// the --locret-* options, made from the one table (locret-options.cpp), for common_params_parser_init
std::vector<common_arg> locret_common_args();

// Speculative decoding with a budget: the n-gram kinds are served; a draft model, or any kind with SAGE-KV, is refused.
// The reason ("" when allowed or without a budget).
std::string locret_common_speculation_refused(const common_params & params);

// Before anything is loaded: --locret-budget-mib becomes a budget in units (params.locret.budget, logged), the
// llama.cpp features an evicting cache cannot serve are refused, and, when fitting (-fit), the context in `cparams`
// becomes the cells the cache will hold. Returns false, with the reason logged, when the tool must stop.
bool locret_common_before_load(common_params & params, llama_context_params & cparams, bool fit);

// A draft model (-md, draft-simple) when the target evicts: the draft context gets its own bounded cache, with
// --locret-draft-budget (default: the target's budget) and --locret-draft-policy (default: heads when the draft model
// has heads, else streaming: attention sinks and the newest units, which needs none). `params` is the draft's copy of
// the parameters. `heads` gets the draft's heads (keep it beside the context). Returns false, with the reason logged.
bool locret_common_configure_draft(const common_params & params, llama_model * model_dft, locret_heads_ptr & heads);

// -fit with a draft model when the target evicts: the draft context's n_ctx becomes the cells its own cache holds
// (params_dft: the draft's copy of the parameters)
void locret_common_fit_draft(const common_params & params_dft, llama_context_params & cparams_dft);

// After -fit: the logical context stays what the user asked for (-c limits positions, not cells)
void locret_common_after_fit(const common_params & params, uint32_t n_ctx_asked, llama_context_params & cparams);

// Before the context is created: heads (--locret-heads, else the model's embedded ones) and the settings registered for
// the model. `heads` gets the heads loaded (keep it beside the context). Returns false, with the reason logged.
bool locret_common_configure(const common_params & params, llama_model * model, locret_heads_ptr & heads);

// Locret-Q: the prompt with the query in front (unchanged without a query)
std::string locret_common_place_query(const common_params & params, const std::string & prompt);

// Before sequence seq_id reads `prompt`: its length decides the heads' pooling for long prompts
// (llama_locret_seq_prompt), and Locret-Q pins the tokens through the query, before anything is evicted. Returns
// false, with the reason logged, when the context does not evict or the query is not at the prompt's start; true
// without a query.
bool locret_common_pin_query(const common_params & params, llama_context * ctx, llama_seq_id seq_id,
                             const std::vector<llama_token> & prompt);
