// llama-server's Locret doors (locret-server.h).

#include "locret-server.h"
#include "locret-options.h"

#include "common.h"
#include "json.h"
#include "llama-locret.h"
#include "log.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <vector>

static bool                g_query_auto = false;
static bool                g_requery    = true;
static const llama_vocab * g_vocab      = nullptr;

void locret_server_set_query_auto(bool on, bool requery, const llama_vocab * vocab) {
    g_query_auto = on;
    g_requery    = requery;
    g_vocab      = vocab;
}

// Locret-Q auto: a request without a query gets `q`, the question found at the end of its text, as its
// "locret_query" (none found: plain Locret); `kept`: q is a chat's first user message's, kept by --locret-requery off
static void locret_auto_query(common_json & body, const std::string & q, bool kept = false) {
    if (!g_query_auto || body.contains("locret_query")) {
        return;
    }
    if (q.empty()) {
        LOG_INF("Locret-Q (auto): no question at the end of the request; plain Locret eviction\n");
        return;
    }
    if (kept) {
        LOG_INF("Locret-Q (auto): the conversation's first question stays at its start and pinned (--locret-requery "
                "off): \"%s\"\n", q.c_str());
    } else {
        LOG_INF("Locret-Q (auto): the request's closing question goes to its start and is pinned: \"%s\"\n", q.c_str());
    }
    body["locret_query"] = q;
}

// a message of role user whose content is a string (a message whose content is parts is not searched)
static bool locret_is_user_text(const common_json & m) {
    return m.contains("role") && m.at("role").is_string() && m.at("role").get<std::string>() == "user" &&
           m.contains("content") && m.at("content").is_string();
}

// a request's query: a string with something besides whitespace
static std::string locret_request_query(const common_json & body) {
    const common_json & q = body.at("locret_query");
    if (!q.is_string() || q.get<std::string>().find_first_not_of(" \t\r\n") == std::string::npos) {
        throw std::invalid_argument("'locret_query' must be a non-empty string");
    }
    return q.get<std::string>();
}

void locret_server_place_chat_query(common_json & body) {
    if (!body.contains("messages") || !body.at("messages").is_array()) {
        return; // without messages, the server's own parser gives its error
    }
    if (g_query_auto && !body.contains("locret_query")) {
        // which user message's question is the chat's query: the library's rule (llama_locret_chat_query_message)
        std::vector<std::string>  texts;
        std::vector<const char *> ptrs;
        for (const auto & m : body.at("messages")) {
            if (locret_is_user_text(m)) {
                texts.push_back(m.at("content").get<std::string>());
            }
        }
        for (const auto & t : texts) {
            ptrs.push_back(t.c_str());
        }
        const int32_t i = llama_locret_chat_query_message(ptrs.data(), (int32_t) ptrs.size(), g_requery);
        if (i >= 0) {
            // kept: a later user message (a follow-up) keeps the first question as its query
            locret_auto_query(body, locret_find_question(texts[i]), i + 1 < (int32_t) texts.size());
        } else {
            locret_auto_query(body, "");
        }
    }
    if (!body.contains("locret_query")) {
        return;
    }
    const std::string query = locret_request_query(body);
    // Locret-Q's layout opens the first user turn: the query heads were trained on the query before the document
    for (auto & m : body.at("messages")) {
        if (!m.contains("role") || !m.at("role").is_string() || m.at("role").get<std::string>() != "user") {
            continue;
        }
        if (!m.contains("content") || !m.at("content").is_string()) {
            break;
        }
        m["content"] = locret_query_layout(query, m.at("content").get<std::string>());
        return;
    }
    throw std::invalid_argument("'locret_query' needs a user message whose content is a string");
}

void locret_server_place_completion_query(common_json & body) {
    // a completion prompt may hold a chat template written out: the question is its last user turn's, and the query
    // opens its first user turn's text (llama_locret_prompt_layout), as in a chat
    if (g_query_auto && !body.contains("locret_query") && body.contains("prompt") && body.at("prompt").is_string()) {
        locret_auto_query(body, locret_find_prompt_question(g_vocab, body.at("prompt").get<std::string>()));
    }
    if (!body.contains("locret_query")) {
        return;
    }
    const std::string query = locret_request_query(body);
    if (!body.contains("prompt") || !body.at("prompt").is_string()) {
        throw std::invalid_argument("'locret_query' needs a 'prompt' that is a string");
    }
    body["prompt"] = locret_prompt_layout(g_vocab, query, body.at("prompt").get<std::string>());
}

std::string locret_server_task_query(const common_json & data) {
    if (!data.contains("locret_query")) {
        return "";
    }
    if (!data.at("locret_query").is_string()) {
        throw std::invalid_argument("'locret_query' must be a non-empty string");
    }
    return data.at("locret_query").get<std::string>();
}

bool locret_server_slot_start(llama_context * ctx, const llama_vocab * vocab, llama_seq_id seq_id, llama_pos p0,
        int32_t n_cached, const std::vector<llama_token> & tokens, const std::string & query, bool * clear_cached,
        std::string * error) {
    *clear_cached = false;
    if (!llama_locret_is_evicting(ctx)) {
        return true; // the server cuts its own cache back
    }
    llama_memory_t mem = llama_get_memory(ctx);
    // an evicting cache cannot take back positions inside its compressed part: when the new prompt leaves the cached
    // one there, the whole prompt is processed again instead of being mixed
    if (!llama_memory_seq_rm(mem, seq_id, p0, -1)) {
        LOG_INF("Locret: slot %d: the cached prompt diverges inside the compressed part (position %d): processing the "
                "whole prompt again (%zu tokens)\n", seq_id, p0, tokens.size());
        llama_memory_seq_rm(mem, seq_id, -1, -1);
        *clear_cached = true;
        n_cached = 0;
    }
    // pooling for long prompts is decided by the prompt a sequence starts with (a follow-up keeps the decision)
    llama_locret_seq_prompt(ctx, seq_id, (int32_t) tokens.size());
    // Locret-Q: the tokens through the query are pinned before any of the prompt can be evicted; a cached prompt
    // pinned otherwise, and already evicted, is processed again
    int32_t n_pin = 0;
    if (!query.empty()) {
        n_pin = llama_locret_query_tokens(vocab, tokens.data(), (int32_t) tokens.size(), query.c_str(),
                (int32_t) llama_locret_get_stats(ctx).budget);
    }
    bool pinned = n_pin >= 0 && llama_locret_pin_query(ctx, seq_id, n_pin) == 0;
    if (n_pin >= 0 && !pinned && n_cached > 0) {
        // a follow-up's new question: what the slot kept was chosen for another one (its cost, the re-read, logged)
        LOG_INF("Locret-Q: slot %d: the cached prompt was read with another question pinned: processing the whole "
                "prompt again with this one (%zu tokens)\n", seq_id, tokens.size());
        llama_memory_seq_rm(mem, seq_id, -1, -1);
        *clear_cached = true;
        llama_locret_seq_prompt(ctx, seq_id, (int32_t) tokens.size());
        pinned = llama_locret_pin_query(ctx, seq_id, n_pin) == 0;
    }
    if (!pinned) {
        *error = std::string("Locret-Q: ") + llama_locret_last_error();
        return false;
    }
    return true;
}

int locret_server_draft_max(llama_context * ctx_tgt, llama_context * ctx_dft, llama_seq_id seq_id, int n_draft_max) {
    // the verification batch (the sampled token and the draft) must fit the target's room; a draft model's context
    // reads the sampled token and the draft while drafting, then the verification batch, within its own room
    for (llama_context * ctx : { ctx_tgt, ctx_dft }) {
        const int32_t room = ctx != nullptr && llama_locret_is_evicting(ctx) ? llama_locret_seq_room(ctx, seq_id) : -1;
        if (room >= 0) {
            n_draft_max = std::min(n_draft_max, (int) room - 1);
        }
    }
    return n_draft_max;
}

static common_json g_props;      // the resolved settings /props shows (null: the context does not evict)
static bool        g_evicting = false;

void locret_server_init(const llama_context * ctx, common_params & params) {
    g_evicting = llama_locret_is_evicting(ctx);
    if (!g_evicting) {
        return;
    }
    if (params.n_ctx_checkpoints > 0) {
        // a checkpoint saves the window cache alone, which an evicting cache does not allow
        LOG_INF("context checkpoints disabled: the KV cache evicts (Locret)\n");
        params.n_ctx_checkpoints = 0;
    }
    const llama_locret_stats st = llama_locret_get_stats(ctx);
    const locret_options & o = params.locret;
    g_props = {
        {"budget",          st.budget},
        {"budget_schedule", o.budget_schedule},
        {"policy",          llama_locret_policy_name(st.policy)},
        {"heads",           o.heads.empty() ? params.model.path : o.heads},
        {"stabilizers",     st.stabilizers},
        {"local",           st.local},
        {"pool",            st.pool_window},
        {"pool_from",       st.pool_from},
        {"policy_settings", st.policy_settings},
        {"positions",       llama_locret_positions_name(st.positions)},
        {"position_limit",  st.position_limit},
        {"query",           o.query_auto_on ? "auto" : o.query.empty() ? "off" : "given"},
        {"requery",         o.requery},
        {"n_ubatch",        st.n_ubatch},
        {"n_cells",         st.n_cells},
        {"kv_bytes",        st.kv_bytes},
    };
}

void locret_server_props(common_json & props) {
    if (g_evicting) {
        props["locret"] = g_props;
    }
}

void locret_server_slot_state(const llama_context * ctx, llama_seq_id seq_id, common_json & slot) {
    if (!llama_locret_is_evicting(ctx)) {
        return;
    }
    const llama_locret_stats st = llama_locret_get_seq_stats(ctx, seq_id);
    slot["locret"] = {
        {"budget",          st.budget},
        {"policy",          llama_locret_policy_name(st.policy)},
        {"n_cells_used",    st.n_cells_used},
        {"n_cells",         st.n_cells},
        {"pos_logical",     st.pos_logical},
        {"n_evictions",     st.n_evictions},
        {"n_units_evicted", st.n_units_evicted},
        {"n_pinned",        st.n_pinned},
        {"pool",            st.pool},
    };
}

std::string locret_server_metrics(const llama_context * ctx, int n_slots) {
    if (!llama_locret_is_evicting(ctx)) {
        return "";
    }
    const llama_locret_stats st = llama_locret_get_stats(ctx);
    std::ostringstream out;
    // counts are written as integers (a double's default format would round a large one)
    auto item = [&](const char * type, const char * name, const char * help, const std::string & value) {
        out << "# HELP llamacpp:" << name << " " << help << "\n"
            << "# TYPE llamacpp:" << name << " " << type << "\n"
            << "llamacpp:" << name << " " << value << "\n";
    };
    item("counter", "locret_evictions_total", "Locret: evictions, all slots", std::to_string(st.n_evictions_total));
    item("counter", "locret_units_evicted_total", "Locret: KV units evicted (one per layer, KV head and token), all slots",
         std::to_string(st.n_units_evicted_total));
    item("counter", "locret_eviction_seconds_total", "Locret: time spent choosing, reading back and compacting",
         string_format("%.6f", (double) (st.t_select_us + st.t_compact_us + st.t_readback_us) / 1e6));
    item("gauge", "locret_budget", "Locret: KV units each slot keeps per layer and KV head", std::to_string(st.budget));
    item("gauge", "locret_kv_bytes", "Locret: bytes of the K and V cache tensors, all slots", std::to_string(st.kv_bytes));
    out << "# HELP llamacpp:locret_cells_used Locret: KV cells holding units, per slot\n"
        << "# TYPE llamacpp:locret_cells_used gauge\n";
    for (int i = 0; i < n_slots; ++i) {
        out << "llamacpp:locret_cells_used{slot=\"" << i << "\"} " << llama_locret_get_seq_stats(ctx, i).n_cells_used
            << "\n";
    }
    return out.str();
}
