// A policy's own settings (--locret-policy NAME:key=value,...), without a model: the spec parsed through the public
// API, each refusal naming the key, the values each policy's knob table gives, the string printed back, the check a
// state file's saved settings pass or fail, the settings rules of the rule book, and each policy's traits (what
// planners read instead of its name) against the rules they stand for.
//
//   test-locret-policy-settings
#include "llama-locret.h"
#include "locret-policy.h"
#include "locret-settings.h"

#include <cstring>
#include <string>
#include <vector>

#include "test-checks.h"

static bool contains(const std::string & s, const char * what) {
    return s.find(what) != std::string::npos;
}

// the spec accepted: its policy and the settings part
static void check_accepted(const char * spec, llama_locret_policy want, const char * want_settings) {
    llama_locret_policy got = LLAMA_LOCRET_POLICY_HEADS;
    const char * settings = nullptr;
    const int32_t rc = llama_locret_policy_from_spec(spec, &got, &settings);
    CHECK(rc == 0, "'%s' refused: %s", spec, llama_locret_last_error());
    if (rc == 0) {
        CHECK_EQ(got, want);
        CHECK(settings != nullptr && std::strcmp(settings, want_settings) == 0, "'%s': settings '%s'", spec,
              settings ? settings : "(null)");
    }
}

// the spec refused, with `why` in the message
static void check_refused(const char * spec, const char * why) {
    llama_locret_policy got;
    const char * settings = nullptr;
    const int32_t rc = llama_locret_policy_from_spec(spec, &got, &settings);
    CHECK(rc == -1, "'%s' accepted", spec);
    CHECK(contains(llama_locret_last_error(), why), "'%s': message '%s' lacks '%s'", spec, llama_locret_last_error(), why);
}

static locret_policy_values parsed(llama_locret_policy id, const char * text) {
    locret_policy_values v;
    std::string err;
    CHECK(locret_policy_settings_parse(*locret_policy_find(id), text, v, err), "'%s' refused: %s", text, err.c_str());
    return v;
}

static void test_specs() {
    check_accepted("lagkv", LLAMA_LOCRET_POLICY_LAGKV, "");
    check_accepted("lagkv:lag=64", LLAMA_LOCRET_POLICY_LAGKV, "lag=64");
    check_accepted("lagkv:", LLAMA_LOCRET_POLICY_LAGKV, "");
    check_accepted("snapkv:window=16,pool=3", LLAMA_LOCRET_POLICY_SNAPKV, "window=16,pool=3");
    check_accepted("heads", LLAMA_LOCRET_POLICY_HEADS, "");

    check_refused("lagkv:lags=3", "policy lagkv has no setting 'lags' (its settings: lag)");
    check_refused("lagkv:lag=1", "lagkv:lag must be an integer from 2 to 65536 (got '1')");
    check_refused("lagkv:lag=65537", "from 2 to 65536");
    check_refused("lagkv:lag=x", "(got 'x')");
    check_refused("lagkv:lag=12x", "(got '12x')");
    check_refused("lagkv:lag=", "(got '')");
    check_refused("lagkv:lag=99999999999999999999", "from 2 to 65536");
    check_refused("lagkv:lag=4,lag=5", "lagkv:lag is given twice");
    check_refused("lagkv:lag", "key=value pairs separated by commas (got 'lag')");
    check_refused("lagkv:=4", "key=value pairs");
    check_refused("lagkv:lag=4,", "key=value pairs");
    check_refused("heads:lag=4", "policy heads has no settings (got 'lag=4')");
    check_refused("snapkv:window=0", "snapkv:window must be an integer from 1 to 4096");
    check_refused("snapkv:lag=4", "policy snapkv has no setting 'lag' (its settings: window, question, pool)");
    check_refused("nope:lag=4", "unknown Locret policy 'nope'");
    check_refused(nullptr, "unknown Locret policy");
}

static void test_values_and_strings() {
    const locret_policy_entry & lagkv  = *locret_policy_find(LLAMA_LOCRET_POLICY_LAGKV);
    const locret_policy_entry & snapkv = *locret_policy_find(LLAMA_LOCRET_POLICY_SNAPKV);
    const locret_policy_entry & heads  = *locret_policy_find(LLAMA_LOCRET_POLICY_HEADS);

    locret_policy_values v = parsed(LLAMA_LOCRET_POLICY_LAGKV, nullptr);
    CHECK_EQ(v.n, 1);
    CHECK_EQ(v.value[0], 128); // the paper's L
    CHECK_EQ(v.given, 0);
    CHECK(locret_policy_settings_str(lagkv, v) == "lag=128", "%s", locret_policy_settings_str(lagkv, v).c_str());

    v = parsed(LLAMA_LOCRET_POLICY_LAGKV, "lag=64");
    CHECK_EQ(v.value[0], 64);
    CHECK_EQ(v.given, 1);
    CHECK(locret_policy_settings_str(lagkv, v) == "lag=64", "%s", locret_policy_settings_str(lagkv, v).c_str());

    v = parsed(LLAMA_LOCRET_POLICY_SNAPKV, "pool=3,window=16");
    CHECK_EQ(v.n, 3);
    CHECK_EQ(v.value[0], 16);
    CHECK_EQ(v.value[1], 64);
    CHECK_EQ(v.value[2], 3);
    CHECK_EQ(v.given, 0x5);
    CHECK(locret_policy_settings_str(snapkv, v) == "window=16,question=64,pool=3", "%s",
          locret_policy_settings_str(snapkv, v).c_str());

    v = parsed(LLAMA_LOCRET_POLICY_HEADS, "");
    CHECK_EQ(v.n, 0);
    CHECK(locret_policy_settings_str(heads, v).empty(), "heads printed settings");

    CHECK(contains(llama_locret_policy_settings_help(LLAMA_LOCRET_POLICY_LAGKV), "lag=N: units per partition (2-65536; default 128)"),
          "%s", llama_locret_policy_settings_help(LLAMA_LOCRET_POLICY_LAGKV));
    CHECK(std::strcmp(llama_locret_policy_settings_help(LLAMA_LOCRET_POLICY_HEADS), "") == 0, "heads has settings help");
    CHECK(llama_locret_policy_settings_help((llama_locret_policy) 99) == nullptr, "help of policy 99");
    CHECK(contains(llama_locret_policies_help(), "lagkv:lag=N"), "%s", llama_locret_policies_help());
}

// what a state file's saved settings are checked against
static void test_saved_settings() {
    const locret_policy_entry & lagkv = *locret_policy_find(LLAMA_LOCRET_POLICY_LAGKV);
    const uint32_t version = lagkv.make()->settings_version();
    const locret_policy_values cur = parsed(LLAMA_LOCRET_POLICY_LAGKV, "lag=8");
    CHECK(locret_policy_settings_mismatch(lagkv, version, { 8 }, cur).empty(), "the same settings refused");
    const std::string other = locret_policy_settings_mismatch(lagkv, version, { 16 }, cur);
    CHECK(other == "the saved state was made with policy settings lag=16, this context's are lag=8", "%s", other.c_str());
    CHECK(contains(locret_policy_settings_mismatch(lagkv, version + 1, { 8 }, cur), "layout"), "another layout accepted");
    CHECK(!locret_policy_settings_mismatch(lagkv, version, { 8, 1 }, cur).empty(), "more values accepted");
    CHECK(!locret_policy_settings_mismatch(lagkv, version, {}, cur).empty(), "no values accepted");
}

// the rule book reads the policy's settings with the rest (no model)
static void test_rule_book() {
    llama_locret_params p = llama_locret_params_default();
    p.budget = 512;
    p.policy = LLAMA_LOCRET_POLICY_SNAPKV;
    CHECK(locret_params_problem(p).empty(), "%s", locret_params_problem(p).c_str());
    p.policy_settings = "pool=4";
    CHECK(contains(locret_params_problem(p), "snapkv:pool must be odd"), "%s", locret_params_problem(p).c_str());
    p.policy_settings = "pool=3";
    p.pool = 5;
    CHECK(contains(locret_params_problem(p), "snapkv:pool and --locret-pool both set"), "%s",
          locret_params_problem(p).c_str());
    p.policy_settings = "window=16";
    CHECK(locret_params_problem(p).empty(), "%s", locret_params_problem(p).c_str());
    p.policy   = LLAMA_LOCRET_POLICY_LAGKV;
    p.pool     = -1;
    p.policy_settings = "window=16";
    CHECK(contains(locret_params_problem(p), "policy lagkv has no setting 'window'"), "%s", locret_params_problem(p).c_str());
}

// the traits planners read instead of policy names agree with the rules they stand for
static void test_traits() {
    llama_locret_policy_traits t;
    CHECK_EQ(llama_locret_policy_get_traits(LLAMA_LOCRET_POLICY_HEADS, &t), 0);
    CHECK(t.needs_heads && t.per_layer_budgets && t.pools_scores && !t.reads_prompt_whole && !t.sets_own_stabilizers &&
          !t.reads_cells_in_order && t.takes_pinned_query && !t.has_settings, "heads");
    CHECK_EQ(llama_locret_policy_get_traits(LLAMA_LOCRET_POLICY_SAGE, &t), 0);
    CHECK(!t.needs_heads && !t.per_layer_budgets && t.reads_prompt_whole && t.sets_own_stabilizers &&
          t.reads_cells_in_order && !t.takes_pinned_query && !t.has_settings, "sage");
    CHECK_EQ(llama_locret_policy_get_traits(LLAMA_LOCRET_POLICY_LAGKV, &t), 0);
    CHECK(!t.needs_heads && !t.pools_scores && t.reads_cells_in_order && t.has_settings, "lagkv");
    CHECK_EQ(llama_locret_policy_get_traits(LLAMA_LOCRET_POLICY_SNAPKV, &t), 0);
    CHECK(t.pools_scores && t.has_settings && t.takes_pinned_query, "snapkv");
    CHECK_EQ(llama_locret_policy_get_traits((llama_locret_policy) 99, &t), -1);

    // a trait and the rule it stands for: a policy that sets its own stabilizers refuses given ones
    for (int32_t i = 0; i < llama_locret_policy_count(); ++i) {
        llama_locret_policy_get_traits((llama_locret_policy) i, &t);
        llama_locret_params p = llama_locret_params_default();
        p.budget      = 512;
        p.policy      = (llama_locret_policy) i;
        p.stabilizers = 8;
        CHECK(locret_params_problem(p).empty() != t.sets_own_stabilizers, "policy %d: stabilizers: %s", i,
              locret_params_problem(p).c_str());
        p.stabilizers = -1;
        p.pool        = 3;
        CHECK(locret_params_problem(p).empty() == t.pools_scores, "policy %d: pool: %s", i, locret_params_problem(p).c_str());
    }
}

int main() {
    test_specs();
    test_values_and_strings();
    test_saved_settings();
    test_rule_book();
    test_traits();
    if (g_failures == 0) {
        std::printf("ok: policy settings\n");
    }
    return g_failures == 0 ? 0 : 1;
}
