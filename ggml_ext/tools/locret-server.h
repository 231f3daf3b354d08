// The doors through which llama-server reaches Locret: a request's Locret-Q query placed in its prompt, and a slot's
// start on an evicting cache (the cached prompt cut back or dropped, the query pinned). The server's patch calls these
// and keeps only its own bookkeeping; what they decide lives here.
#pragma once

#include "llama.h"
#include "llama-locret.h"

#include <string>
#include <vector>

class common_json;
struct common_params;

// Locret-Q auto in effect for the requests that give no query (locret_common_configure sets it when the model is
// configured): the question at the end of the request's last user message (chat) or prompt (completion) becomes the
// request's "locret_query". Without requery (--locret-requery off), a chat's query is the question of its first user
// message that has one: a follow-up keeps the prompt the slot has cached and reads only its new tokens.
// `vocab`: the model's, whose control tokens are the chat template markers a completion prompt may hold.
void locret_server_set_query_auto(bool on, bool requery, const llama_vocab * vocab);

// Locret-Q, a chat request (OpenAI messages): the body's "locret_query" (or, with auto and none given, the question at
// the end of the last user message; without requery, of the first user message that ends with one) opens its first
// user turn, in Locret-Q's layout (locret_query_layout). Throws
// std::invalid_argument with the reason for a query that is not a non-empty string or a request without a user message
// whose content is a string. A body without a query is left as it is.
void locret_server_place_chat_query(common_json & body);

// Locret-Q, a completion request: the body's "locret_query" (or, with auto and none given, the question at the end of
// its prompt) goes in front of its prompt (a string). Throws std::invalid_argument like the chat form.
void locret_server_place_completion_query(common_json & body);

// the request's query, as the task keeps it to pin when a slot takes it ("" without one); throws
// std::invalid_argument for one that is not a string
std::string locret_server_task_query(const common_json & data);

// A slot is about to read a prompt on an evicting cache: the cache is cut back to p0 (the end of what the slot's cached
// prompt shares with the new one), and the request's query (if any) is pinned in sequence seq_id. When the cut falls
// inside the compressed part, or the cached prompt was pinned otherwise and has already evicted, the sequence is
// emptied and *clear_cached set: the server must drop its cached prompt and process the whole prompt. Returns false,
// with the reason in *error, when the request must be refused (a query the budget cannot hold, or not at the prompt's
// start). `tokens`: the whole new prompt; `n_cached`: the tokens the slot holds of it. Nothing (true) on a cache that
// does not evict.
bool locret_server_slot_start(llama_context * ctx, const llama_vocab * vocab, llama_seq_id seq_id, llama_pos p0,
                              int32_t n_cached, const std::vector<llama_token> & tokens, const std::string & query,
                              bool * clear_cached, std::string * error);

// Speculative decoding on an evicting cache: the largest draft (after the sampled token) the slot of sequence seq_id may
// verify next, at most n_draft_max: its batch stays within the room before the next eviction (llama_locret_seq_room)
// of the target's cache and of a draft model's (ctx_dft, may be NULL), so the rejected tokens are their newest and the
// evictions fall where they fall without speculation. n_draft_max unchanged when neither evicts.
int locret_server_draft_max(llama_context * ctx_tgt, llama_context * ctx_dft, llama_seq_id seq_id, int n_draft_max);

// Observability. The server's context was made: its resolved Locret settings are kept for /props (which must not read
// the context: it answers while the server sleeps), and context checkpoints are turned off (a checkpoint saves the
// window cache alone, which an evicting cache does not allow). Nothing when the context does not evict.
void locret_server_init(const llama_context * ctx, common_params & params);

// /props: the Locret settings under "locret" (absent without eviction)
void locret_server_props(common_json & props);

// /slots: a slot's Locret state under "locret": budget, policy, cells used and allocated, logical position, evictions and
// units evicted since the slot's sequence was last emptied, pinned query tokens (absent without eviction)
void locret_server_slot_state(const llama_context * ctx, llama_seq_id seq_id, common_json & slot);

// /metrics: Locret's counters (evictions, units evicted, eviction time; all slots since start) and gauges (cells used per
// slot, budget, KV bytes) in Prometheus' text format with llama-server's prefix ("" without eviction)
std::string locret_server_metrics(const llama_context * ctx, int n_slots);
