// Locret-Q for tools and Python: the layout of a prompt with its query, which leading tokens hold the query (the part
// to pin), and the query found in a prompt that has none given (--locret-query auto). Written once, here: the Python
// API calls these same functions (locret.query.place_query and find_question, locret.eviction.query_tokens), so that
// the tools and Python build the same text and pin the same tokens.

#include "llama-locret.h"

#include "locret-heads.h"

#include "llama-impl.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

// writes at most n_out - 1 bytes of s and a NUL into out (when not NULL); returns s's length, like snprintf
static int32_t locret_copy_out(const std::string & s, char * out, int32_t n_out) {
    if (out != nullptr && n_out > 0) {
        const size_t n = std::min(s.size(), (size_t) n_out - 1);
        std::memcpy(out, s.data(), n);
        out[n] = '\0';
    }
    return (int32_t) s.size();
}

// Locret-Q's layout as a string (llama_locret_query_layout)
static std::string locret_query_layout(const char * query, const std::string & text) {
    // the query without surrounding white space (a query file's last line end would otherwise widen the separator)
    std::string q = query != nullptr ? query : "";
    const size_t first = q.find_first_not_of(" \t\r\n");
    q = first == std::string::npos ? "" : q.substr(first, q.find_last_not_of(" \t\r\n") - first + 1);
    return q + LLAMA_LOCRET_QUERY_SEPARATOR + text;
}

int32_t llama_locret_query_layout(const char * query, const char * text, char * out, int32_t n_out) {
    return locret_copy_out(locret_query_layout(query, text != nullptr ? text : ""), out, n_out);
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

//
// Locret-Q's query found in the prompt itself (--locret-query auto)
//

namespace {

bool locret_is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

std::string locret_trim(const std::string & s) {
    const size_t a = s.find_first_not_of(" \t\r\n");
    return a == std::string::npos ? "" : s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

std::string locret_lower(std::string s) {
    for (char & c : s) {
        c = (char) std::tolower((unsigned char) c);
    }
    return s;
}

// the text with the lines of fenced code blocks (``` or ~~~) blanked: a question in code is the document's, not the user's
std::string locret_without_code(const std::string & text) {
    std::string out;
    out.reserve(text.size());
    bool in_code = false;
    size_t at = 0;
    while (at < text.size()) {
        size_t end = text.find('\n', at);
        end = end == std::string::npos ? text.size() : end + 1;
        const std::string line = text.substr(at, end - at);
        const std::string t = locret_trim(line);
        const bool fence = t.rfind("```", 0) == 0 || t.rfind("~~~", 0) == 0;
        if (fence || in_code) {
            out += std::string(line.size() - (line.back() == '\n'), ' ') + (line.back() == '\n' ? "\n" : "");
        } else {
            out += line;
        }
        in_code = fence ? !in_code : in_code;
        at = end;
    }
    return out;
}

// the start of the text's last paragraph (after its last blank line)
size_t locret_last_paragraph(const std::string & s) {
    for (size_t i = s.size(); i-- > 0;) {
        if (s[i] != '\n') {
            continue;
        }
        // a blank line: another line end before this one with only white space between
        size_t j = i;
        while (j > 0 && (s[j - 1] == ' ' || s[j - 1] == '\t' || s[j - 1] == '\r')) {
            --j;
        }
        if (j > 0 && s[j - 1] == '\n') {
            return i + 1;
        }
    }
    return 0;
}

// the text after the last line that opens with a question marker ("Question:", "Q:", "Query:"), searched in the
// last `window` bytes; npos when there is none
size_t locret_after_marker(const std::string & s, size_t window) {
    static const char * markers[] = { "question:", "q:", "query:" };
    // from the first whole line inside the window (a line cut by the window's start is not a line start)
    const size_t from = s.size() > window ? s.find('\n', s.size() - window) : 0;
    if (from == std::string::npos) {
        return std::string::npos;
    }
    size_t best = std::string::npos;
    size_t at = from == 0 ? 0 : from + 1;
    while (at < s.size()) {
        // the line [at, end)
        size_t end = s.find('\n', at);
        end = end == std::string::npos ? s.size() : end;
        size_t b = at;
        while (b < end && (s[b] == ' ' || s[b] == '\t' || s[b] == '*' || s[b] == '#')) {
            ++b; // markdown emphasis or a heading around the marker
        }
        const std::string head = locret_lower(s.substr(b, 10));
        for (const char * m : markers) {
            if (head.rfind(m, 0) == 0) {
                best = b + std::strlen(m);
            }
        }
        at = end + 1;
    }
    return best;
}

// a paragraph reads as a question: a question mark, or a first word that asks or tells
bool locret_reads_as_question(const std::string & span) {
    if (span.find('?') != std::string::npos) {
        return true;
    }
    static const char * words[] = { "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "is", "are",
        "was", "were", "do", "does", "did", "can", "could", "should", "would", "will", "list", "name", "give", "tell",
        "find", "return", "answer", "summarize", "summarise", "explain", "identify", "quote", "state", "recall" };
    size_t end = 0;
    while (end < span.size() && std::isalpha((unsigned char) span[end])) {
        ++end;
    }
    const std::string first = locret_lower(span.substr(0, end));
    if (end < span.size() && span[end] == ':') {
        return false; // a field label ("Name: ..."), not a request
    }
    for (const char * w : words) {
        if (first == w) {
            return true;
        }
    }
    return false;
}

// where the span's sentences start: its first byte, a byte after ". ", "? " or "! ", and a line that does not open
// in lower case (a line opening in lower case continues the sentence above it; a haystack glued to the question's
// line, as RULER's prompts are, ends at the line end)
std::vector<size_t> locret_sentence_starts(const std::string & span) {
    std::vector<size_t> starts;
    size_t i = 0;
    while (i < span.size() && locret_is_space(span[i])) {
        ++i;
    }
    if (i < span.size()) {
        starts.push_back(i);
    }
    for (++i; i < span.size(); ++i) {
        if (locret_is_space(span[i]) || !locret_is_space(span[i - 1])) {
            continue;
        }
        // span[i] opens a word after white space [j, i)
        size_t j = i;
        bool line_start = false;
        while (j > 0 && locret_is_space(span[j - 1])) {
            line_start = line_start || span[j - 1] == '\n';
            --j;
        }
        const char before = j > 0 ? span[j - 1] : '\0';
        if (before == '.' || before == '?' || before == '!' ||
                (line_start && !std::islower((unsigned char) span[i]))) {
            starts.push_back(i);
        }
    }
    return starts;
}

// the sentence of the span that starts at starts[k], trimmed
std::string locret_sentence(const std::string & span, const std::vector<size_t> & starts, size_t k) {
    const size_t end = k + 1 < starts.size() ? starts[k + 1] : span.size();
    return locret_trim(span.substr(starts[k], end - starts[k]));
}

// where the span's closing run of sentences starts whose reading as a question is `asks` (the sentences that ask at
// its end, or those after the last that asks): the first such sentence's start, or span.size() when the last
// sentence is not of that kind
size_t locret_closing_run(const std::string & span, bool asks) {
    const std::vector<size_t> starts = locret_sentence_starts(span);
    size_t from = span.size();
    for (size_t k = starts.size(); k-- > 0 && locret_reads_as_question(locret_sentence(span, starts, k)) == asks;) {
        from = starts[k];
    }
    return from;
}

// the question without what follows it: an answer's cue (the last sentence opening with "Answer:" or "A:", as RULER's
// and many prompts end, when no question follows it: an earlier one is a document's "Q: ... A: ..." line) and, after
// a question mark, the sentences that do not ask (an answer prefix such as RULER's "The special magic number for X
// mentioned in the provided text is"); a remark that tells ("Answer with the number only.") stays, as the user wrote it
std::string locret_question_end(const std::string & span) {
    std::string q = span;
    size_t cue = std::string::npos;
    for (const size_t s : locret_sentence_starts(q)) {
        const std::string head = locret_lower(q.substr(s, 7));
        if (head.rfind("answer:", 0) == 0 || head.rfind("a:", 0) == 0) {
            cue = s;
        }
    }
    if (cue != std::string::npos && q.find('?', cue) == std::string::npos) {
        q = q.substr(0, cue);
    }
    if (q.find('?') == std::string::npos) {
        return locret_trim(q);
    }
    return locret_trim(q.substr(0, locret_closing_run(q, /*asks =*/ false)));
}

// the closing run of sentences that ask (each holds a question mark or opens with a word that asks or tells), so a
// document's sentences on the question's line or in its paragraph are not pinned as the question; a span with no
// question mark (an instruction) is kept whole
std::string locret_asking_sentences(const std::string & span) {
    if (span.find('?') == std::string::npos) {
        return span;
    }
    const size_t from = locret_closing_run(span, /*asks =*/ true);
    return from == span.size() ? "" : locret_trim(span.substr(from));
}

// the span's trailing whole sentences that fit in max_bytes ("" when even the last does not fit)
std::string locret_fit_sentences(const std::string & span, size_t max_bytes) {
    if (span.size() <= max_bytes) {
        return span;
    }
    for (const size_t s : locret_sentence_starts(span)) {
        if (span.size() - s <= max_bytes) {
            return locret_trim(span.substr(s));
        }
    }
    return "";
}

} // namespace

static std::string locret_find_question(const std::string & text) {
    const std::string clean = locret_trim(locret_without_code(text));
    if (clean.empty()) {
        return "";
    }
    const size_t max_bytes = LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES;
    const size_t marker = locret_after_marker(clean, 4 * max_bytes);
    if (marker != std::string::npos) {
        // a marked question: what follows the marker (on its line or the next ones), after the emphasis closing it
        const size_t start = clean.find_first_not_of(" \t\r\n*_", marker);
        return start == std::string::npos ? "" :
                locret_fit_sentences(locret_question_end(clean.substr(start)), max_bytes);
    }
    const std::string span = locret_trim(clean.substr(locret_last_paragraph(clean)));
    if (!locret_reads_as_question(span)) {
        return ""; // a document with no question at its end
    }
    const std::string fitted = locret_fit_sentences(locret_asking_sentences(locret_question_end(span)), max_bytes);
    return locret_reads_as_question(fitted) ? fitted : "";
}

int32_t llama_locret_find_question(const char * text, char * out, int32_t n_out) {
    return locret_copy_out(locret_find_question(text != nullptr ? text : ""), out, n_out);
}

//
// Locret-Q on a completion prompt that holds a chat template written out as text
//

namespace {

// a turn of a prompt: its role ("" when its piece names none) and its text [begin, end), byte offsets in the prompt
struct locret_turn {
    std::string role;
    size_t      begin;
    size_t      end;
};

// the model's control tokens as text (a chat template's markers), for finding them in a prompt
struct locret_markers {
    std::unordered_set<std::string> texts;
    std::vector<size_t>             lengths;       // the distinct lengths, longest first (the longest marker wins)
    bool                            first[256] = {}; // the bytes a marker opens with
};

locret_markers locret_control_markers(const llama_vocab * vocab) {
    locret_markers m;
    if (vocab == nullptr) {
        return m;
    }
    char buf[256];
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t = 0; t < n_vocab; ++t) {
        if (!llama_vocab_is_control(vocab, t)) {
            continue;
        }
        const int32_t len = llama_token_to_piece(vocab, t, buf, sizeof(buf), 0, /*special =*/ true);
        if (len <= 0) {
            continue; // a control token with no text (or one too long to be a template's marker)
        }
        m.texts.emplace(buf, (size_t) len);
        m.first[(unsigned char) buf[0]] = true;
        if (std::find(m.lengths.begin(), m.lengths.end(), (size_t) len) == m.lengths.end()) {
            m.lengths.push_back((size_t) len);
        }
    }
    std::sort(m.lengths.rbegin(), m.lengths.rend());
    return m;
}

// the length of the marker that starts at text[i], 0 when none does
size_t locret_marker_at(const locret_markers & m, const std::string & text, size_t i) {
    if (!m.first[(unsigned char) text[i]]) {
        return 0;
    }
    for (const size_t len : m.lengths) {
        if (i + len <= text.size() && m.texts.count(text.substr(i, len)) > 0) {
            return len;
        }
    }
    return 0;
}

// a role's name as chat templates write it on the line after a turn's marker
bool locret_is_role(const std::string & word) {
    static const char * roles[] = { "system", "developer", "user", "human", "assistant", "model", "bot", "gpt", "tool",
        "ipython", "function" };
    const std::string w = locret_lower(word);
    for (const char * r : roles) {
        if (w == r) {
            return true;
        }
    }
    return false;
}

bool locret_is_user(const std::string & role) {
    const std::string r = locret_lower(role);
    return r == "user" || r == "human";
}

bool locret_has_text(const std::string & text, const locret_turn & t) {
    for (size_t i = t.begin; i < t.end; ++i) {
        if (!locret_is_space(text[i])) {
            return true;
        }
    }
    return false;
}

// the prompt's turns (the rule: llama_locret_find_prompt_question in llama-locret.h)
std::vector<locret_turn> locret_prompt_turns(const llama_vocab * vocab, const std::string & text) {
    const locret_markers markers = locret_control_markers(vocab);
    std::vector<locret_turn> turns;
    std::string pending_role; // named by a piece that is a role's name alone (Llama 3), for the next piece
    bool after_marker = false;
    size_t piece = 0;
    const auto close_piece = [&](size_t end) {
        locret_turn t = { "", piece, end };
        if (after_marker) {
            size_t nl = text.find('\n', piece);
            nl = nl == std::string::npos || nl >= end ? end : nl;
            const std::string line = locret_trim(text.substr(piece, nl - piece));
            if (locret_is_role(line) && nl == end) {
                pending_role = line; // the role alone: it names the next piece's
                return;
            }
            if (locret_is_role(line)) {
                t.role  = line;
                t.begin = nl + 1; // the text follows the role's line
            } else if (!pending_role.empty()) {
                t.role = pending_role;
                while (t.begin < end && locret_is_space(text[t.begin])) {
                    ++t.begin; // the template's separator after the role
                }
            }
        }
        pending_role.clear();
        turns.push_back(t);
    };
    for (size_t i = 0; i < text.size();) {
        const size_t len = locret_marker_at(markers, text, i);
        if (len == 0) {
            ++i;
            continue;
        }
        close_piece(i);
        i += len;
        piece = i;
        after_marker = true;
    }
    close_piece(text.size());
    return turns;
}

// the turn Locret-Q's layout opens: the first user turn, else the first turn with text; nullptr when none has text
const locret_turn * locret_query_turn(const std::string & text, const std::vector<locret_turn> & turns) {
    for (const locret_turn & t : turns) {
        if (locret_is_user(t.role)) {
            return &t;
        }
    }
    for (const locret_turn & t : turns) {
        if (locret_has_text(text, t)) {
            return &t;
        }
    }
    return nullptr;
}

// the turn whose closing question Locret-Q auto takes: the last user turn, else the last turn with text
const locret_turn * locret_question_turn(const std::string & text, const std::vector<locret_turn> & turns) {
    for (size_t i = turns.size(); i-- > 0;) {
        if (locret_is_user(turns[i].role)) {
            return &turns[i];
        }
    }
    for (size_t i = turns.size(); i-- > 0;) {
        if (locret_has_text(text, turns[i])) {
            return &turns[i];
        }
    }
    return nullptr;
}

} // namespace

int32_t llama_locret_find_prompt_question(const llama_vocab * vocab, const char * text, char * out, int32_t n_out) {
    const std::string prompt = text != nullptr ? text : "";
    const std::vector<locret_turn> turns = locret_prompt_turns(vocab, prompt);
    const locret_turn * t = locret_question_turn(prompt, turns);
    const std::string q = t == nullptr ? "" : locret_find_question(prompt.substr(t->begin, t->end - t->begin));
    return locret_copy_out(q, out, n_out);
}

int32_t llama_locret_prompt_layout(const llama_vocab * vocab, const char * query, const char * text, char * out,
        int32_t n_out) {
    const std::string prompt = text != nullptr ? text : "";
    const std::vector<locret_turn> turns = locret_prompt_turns(vocab, prompt);
    const locret_turn * t = locret_query_turn(prompt, turns);
    const size_t at = t == nullptr ? 0 : t->begin;
    return locret_copy_out(prompt.substr(0, at) + locret_query_layout(query, prompt.substr(at)), out, n_out);
}

int32_t llama_locret_chat_query_message(const char * const * texts, int32_t n_texts, bool requery) {
    if (texts == nullptr || n_texts <= 0) {
        return -1;
    }
    if (!requery) {
        // the conversation's first question: every later turn's prompt then opens as the first one's did
        for (int32_t i = 0; i < n_texts; ++i) {
            if (!locret_find_question(texts[i] != nullptr ? texts[i] : "").empty()) {
                return i;
            }
        }
    }
    return n_texts - 1;
}

int32_t llama_locret_pin_room(void) {
    return LLAMA_LOCRET_PIN_ROOM;
}
