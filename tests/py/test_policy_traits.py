"""What each policy is (llama_locret_policy_get_traits, locret.eviction.policy_traits): the answers the rule book
reads when it checks settings, given to the Python planner and the evaluation runner so that they branch on what a
policy does, never on its name. The table below is the registry's today; a policy added to the library must be added
here (the first test fails until it is), and the planner then needs no change."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import eviction
from locret.heads import HeadsError

REPO = Path(__file__).resolve().parents[2]

# policy -> its true traits (every other trait is false)
TRAITS = {
    "heads": {"needs_heads", "per_layer_budgets", "pools_scores", "takes_pinned_query"},
    "random": {"per_layer_budgets", "takes_pinned_query"},
    "streaming": {"per_layer_budgets", "takes_pinned_query"},
    "lagkv": {"reads_cells_in_order", "takes_pinned_query", "has_settings"},
    "sage": {"reads_prompt_whole", "sets_own_stabilizers", "reads_cells_in_order"},
    "snapkv": {"pools_scores", "reads_cells_in_order", "takes_pinned_query", "has_settings"},
}
FIELDS = ("needs_heads", "per_layer_budgets", "reads_prompt_whole", "sets_own_stabilizers", "pools_scores",
          "reads_cells_in_order", "takes_pinned_query", "has_settings")

# the code that must know no policy by name: it asks the library's rule book what a policy is
NAMELESS = sorted((REPO / "py" / "locret" / "planner").glob("*.py")) + [
    REPO / "py/locret/evaluation/runner.py", REPO / "py/locret/llama.py", REPO / "py/locret/serve.py"]


def test_each_policy_has_the_traits_of_the_table():
    assert set(eviction.policies()) == set(TRAITS)
    assert eviction.PolicyTraits._fields == FIELDS
    assert tuple(name for name, _ in eviction._PolicyTraits._fields_) == FIELDS  # the C struct's order
    for name, true in TRAITS.items():
        traits = eviction.policy_traits(name)
        assert traits == eviction.PolicyTraits(*(f in true for f in FIELDS)), name
        assert all(isinstance(v, bool) for v in traits), name


def test_a_policys_settings_do_not_change_its_traits_and_none_is_the_default():
    assert eviction.policy_traits("lagkv:lag=32") == eviction.policy_traits("lagkv")
    assert eviction.policy_traits("snapkv:window=16") == eviction.policy_traits("snapkv")
    assert eviction.policy_traits(None) == eviction.policy_traits(eviction.DEFAULT_POLICY) \
        == eviction.policy_traits("heads")
    # the traits agree with what the library says elsewhere: its settings' help, and the keys a policy takes
    for name in eviction.policies():
        assert eviction.policy_traits(name).has_settings == bool(eviction.policy_settings_help(name)), name


@pytest.mark.parametrize("spec, message", [
    ("sag", "unknown Locret policy 'sag'"),
    ("lagkv:lags=32", "policy lagkv has no setting 'lags'"),
])
def test_a_spec_that_is_not_a_policy_is_refused_with_the_librarys_reason(spec, message):
    with pytest.raises(HeadsError, match=message):
        eviction.policy_traits(spec)


def _policy_names_compared(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, source) of each comparison in the file that has a policy's name ("NAME" or "NAME:SETTINGS") among its
    string constants, membership tests (`x in ("heads",)`) included. Assignments (a default `policy = "heads"`) and
    calls are not comparisons."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(
                isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.partition(":")[0] in names
                for sub in ast.walk(node)):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_planner_and_the_runner_compare_no_policy_names():
    assert len(NAMELESS) > 2 and all(p.is_file() for p in NAMELESS)
    found = [f"{path.relative_to(REPO)}:{line}: {source}" for path in NAMELESS
             for line, source in _policy_names_compared(path, set(TRAITS))]
    assert not found, "compare a policy's traits (locret.eviction.policy_traits), not its name:\n" + "\n".join(found)


def test_the_names_check_finds_a_comparison_and_a_membership_test(tmp_path):
    # the check itself: a name compared, a membership test and a NAME:SETTINGS spec are found; a default is not, nor
    # a method's name that is no policy's
    src = tmp_path / "sample.py"
    src.write_text('policy = "heads"\n'
                   'a = policy == "sage"\n'
                   'b = policy in (None, "heads")\n'
                   'c = "lagkv:lag=32" != policy\n'
                   'd = policy == "locret"\n')
    assert _policy_names_compared(src, set(TRAITS)) == [(2, "policy == 'sage'"), (3, "policy in (None, 'heads')"),
                                                        (4, "'lagkv:lag=32' != policy")]
