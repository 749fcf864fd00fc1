"""`builtin:reasoning_gym/<dataset>`: task families in the registry, the spec's knobs and errors, held-out rows
disjoint by content, answer extraction, and the dataset's own scorer as reward and metric. The family tests need
reasoning-gym (`pip install 'lit_rlhf[reasoning-gym]'`) and skip without it; the registry tests do not."""

from __future__ import annotations

import ast
import itertools
import operator
import os
import sys
from types import SimpleNamespace

import pytest

from lit_rlhf import RolloutDataModule, registry
from lit_rlhf.config import ConfigError
from lit_rlhf.data.sources import builtin_rows
from lit_rlhf.registry import Task, TaskFamily, get_task

SPEC = "chain_sum?min_terms=2&max_terms=3&max_digits=2"


def fake_registry(monkeypatch, **entries):
    loaded = {name: SimpleNamespace(load=lambda v=value: v, value=f"pkg:{name}") for name, value in entries.items()}
    monkeypatch.setattr(registry, "_registered", lambda: loaded)


def stream(text):
    return lambda seed: ({"prompt": f"{text} {seed} {i}"} for i in itertools.count())


# ------------------------------------------------------------------------------------------- the registry


def test_a_family_member_is_made_by_the_family_from_the_rest_of_the_name(monkeypatch):
    made = Task(name="m", tokenizer=object, policy=object, prompts=stream("m"))
    asked = []
    family = TaskFamily(name="fam", member=lambda member, field: asked.append((member, field)) or made, usage="u")
    fake_registry(monkeypatch, fam=family)
    assert get_task("builtin:fam/x?a=1/b", "data.prompts") is made
    assert asked == [("x?a=1/b", "data.prompts")]  # everything after the first '/'
    with pytest.raises(ConfigError, match=r"data.prompts: 'builtin:fam' names a family of tasks; name one of them: u"):
        get_task("builtin:fam", "data.prompts")


def test_a_plain_task_refuses_a_member(monkeypatch):
    fake_registry(monkeypatch, plain=Task(name="plain", tokenizer=object, policy=object, prompts=stream("p")))
    with pytest.raises(ConfigError, match=r"builtin:plain is a task, not a family; drop '/x'"):
        get_task("builtin:plain/x", "model.policy")


def test_held_out_rows_come_from_the_tasks_held_out_stream_when_it_has_one(monkeypatch):
    both = Task(name="b", tokenizer=object, policy=object, prompts=stream("train"), held_out_prompts=stream("held"))
    only = Task(name="o", tokenizer=object, policy=object, prompts=stream("train"))
    fake_registry(monkeypatch, both=both, only=only)
    assert builtin_rows("builtin:both", 7, 2, "data.val_prompts") == [{"prompt": "held 7 0"}, {"prompt": "held 7 1"}]
    assert builtin_rows("builtin:only", 7, 1, "data.val_prompts") == [{"prompt": "train 7 0"}]


def test_a_builtin_test_set_leaves_out_the_validation_rows(monkeypatch):
    """Five distinct prompts: the test set skips the validation set's three, and asking for as many test rows
    as there are prompts leaves none, which is an error naming both settings, not an endless loop."""
    five = Task(
        name="f",
        tokenizer=object,
        policy=object,
        prompts=lambda seed: ({"prompt": f"q{i % 5}"} for i in itertools.count(seed)),
    )
    fake_registry(monkeypatch, five=five)
    data = RolloutDataModule(
        prompts="builtin:five", val_prompts="builtin:five", test_prompts="builtin:five", val_size=3
    )
    val = [row["prompt"] for row in data.val_rows]
    assert val == ["q1", "q2", "q3"]  # seed 1_000_001: 1_000_001 % 5 == 1
    assert [row["prompt"] for row in data.test_rows] == [
        "q4",
        "q0",
        "q4",
    ]  # from 1_000_002 (q2, q3, q4, ...), without q1-q3
    assert [row["prompt"] for row in data.predict_rows] == val  # predict still answers the validation set
    with pytest.raises(
        ConfigError, match=r"data.test_prompts: builtin:five gave only rows already in data.val_prompts"
    ):
        RolloutDataModule(prompts="builtin:five", val_prompts="builtin:five", test_prompts="builtin:five", val_size=5)


def test_without_reasoning_gym_the_error_names_the_extra(monkeypatch):
    from lit_rlhf.tasks import rgym

    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # importing it now raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install 'lit_rlhf\[reasoning-gym\]'"):
        rgym.parse_spec(SPEC, "data.prompts")


# ------------------------------------------------------------------------------------------- the family


@pytest.fixture(scope="module")
def rgym():
    pytest.importorskip("reasoning_gym")
    from lit_rlhf.tasks import rgym

    return rgym


def chain_value(question: str) -> int:
    """The value of chain_sum's 'State the final answer to ...: a + b - c =' by Python's own parser."""
    text = question.rsplit(":", 1)[1].removesuffix("=").strip()
    ops = {ast.Add: operator.add, ast.Sub: operator.sub}

    def walk(node):
        return ops[type(node.op)](walk(node.left), walk(node.right)) if isinstance(node, ast.BinOp) else node.value

    return walk(ast.parse(text, mode="eval").body)


def test_knobs_are_read_as_json_and_checked_by_name(rgym):
    name, knobs, fmt = rgym.parse_spec("chain_sum?max_terms=3&allow_negation=true&answer_format=tags", "f")
    assert (name, knobs, fmt) == ("chain_sum", {"max_terms": 3, "allow_negation": True}, "tags")
    assert rgym.parse_spec("chain_sum", "f") == ("chain_sum", {}, "final")
    with pytest.raises(ConfigError, match=r"f: chain_sum has no knob 'max_term'; its knobs: allow_negation, max_d"):
        rgym.parse_spec("chain_sum?max_term=3", "f")
    with pytest.raises(ConfigError, match=r"f: 'seed' is set by lit_rlhf from data.seed"):
        rgym.parse_spec("chain_sum?seed=3", "f")
    with pytest.raises(ConfigError, match=r"f: 'max_terms' in 'chain_sum\?max_terms' is not <knob>=<value>"):
        rgym.parse_spec("chain_sum?max_terms", "f")
    with pytest.raises(ConfigError, match=r"f: answer_format must be one of \['final', 'last_line', 'tags'\]"):
        rgym.parse_spec("chain_sum?answer_format=boxed", "f")


@pytest.mark.parametrize("text", ["False", "false_", "0", "1", "yes", '"true"'])
def test_a_bool_knob_takes_only_true_or_false(rgym, text):
    """'False' would stay a string (truthy) and 0/1 ints: both would turn negation on or off silently."""
    with pytest.raises(
        ConfigError, match=r"f: chain_sum knob 'allow_negation': .* is not a boolean; write true or false"
    ):
        rgym.parse_spec(f"chain_sum?allow_negation={text}", "f")
    assert rgym.parse_spec("chain_sum?allow_negation=false", "f")[1] == {"allow_negation": False}


def test_a_number_knob_takes_only_a_number(rgym):
    with pytest.raises(ConfigError, match=r"chain_sum knob 'max_terms': 'three' is not a number \(int\)"):
        rgym.parse_spec("chain_sum?max_terms=three", "f")
    with pytest.raises(ConfigError, match=r"chain_sum knob 'max_terms': 2.5 is not an integer"):
        rgym.parse_spec("chain_sum?max_terms=2.5", "f")
    with pytest.raises(ConfigError, match=r"chain_sum knob 'max_terms': True is not a number"):
        rgym.parse_spec("chain_sum?max_terms=true", "f")


def test_an_unknown_dataset_lists_close_names(rgym):
    with pytest.raises(ConfigError, match=r"data.prompts: reasoning-gym has no dataset 'chain_sums'; close names: ch"):
        get_task("builtin:reasoning_gym/chain_sums", "data.prompts")


def test_knob_values_the_dataset_refuses_fail_when_the_task_is_named(rgym):
    with pytest.raises(ConfigError, match=r"data.prompts: chain_sum refuses the knobs \{'min_terms': 4, 'max_terms'"):
        get_task("builtin:reasoning_gym/chain_sum?min_terms=4&max_terms=2", "data.prompts")


def test_knobs_the_generator_cannot_use_fail_when_the_task_is_named(rgym):
    # simple_equations' config takes one operator with its three default weights; only drawing a problem fails
    with pytest.raises(ConfigError, match=r"data.prompts: simple_equations accepts the knobs \{'operators"):
        get_task('builtin:reasoning_gym/simple_equations?operators=["+"]', "data.prompts")
    spec = 'simple_equations?operators=["+"]&operators_weights=[1.0]'
    rows = itertools.islice(get_task(f"builtin:reasoning_gym/{spec}", "data.prompts").prompts(0), 20)
    assert all("*" not in row["rg_entry"]["question"].split("\n")[-1] for row in rows)


def test_enum_knobs_are_given_by_their_values(rgym):
    spec = 'aiw?task_types=["friends"]&task_type_weights=[1.0]'
    rows = list(itertools.islice(get_task(f"builtin:reasoning_gym/{spec}", "data.prompts").prompts(0), 20))
    assert {row["rg_entry"]["metadata"]["task_type"] for row in rows} == {"friends"}
    with pytest.raises(ConfigError, match=r"f: aiw knob 'task_types': 'cousins' is not one of \['siblings', 'fr"):
        rgym.parse_spec('aiw?task_types=["cousins"]', "f")
    assert rgym.parse_spec("word_sorting?transformation=uppercase", "f")[1]["transformation"].value == "uppercase"


def test_rows_are_seeded_chat_rows_with_the_entry_and_the_instruction(rgym):
    task = get_task(f"builtin:reasoning_gym/{SPEC}", "data.prompts")
    rows = list(itertools.islice(task.prompts(0), 50))
    assert rows == list(itertools.islice(task.prompts(0), 50))
    assert rows != list(itertools.islice(task.prompts(1), 50))
    for row in rows:
        entry = row["rg_entry"]
        assert row["messages"] == [
            {"role": "user", "content": entry["question"] + "\nGive the final answer on the last line."}
        ]
        assert (row["rg_task"], row["answer_format"]) == (SPEC, "final")
        assert entry["answer"] == str(chain_value(entry["question"]))
        assert 2 <= len(entry["metadata"]["expression"].split(" ")) // 2 + 1 <= 3  # 2 or 3 terms


def test_reasoning_gym_seeds_overlap_so_held_out_rows_are_split_by_content(rgym):
    from reasoning_gym import create_dataset

    # the reason: item i of seed s is item i - 1 of seed s + 1
    first, second = create_dataset("chain_sum", seed=0, size=5), create_dataset("chain_sum", seed=1, size=5)
    assert first[1]["question"] == second[0]["question"]
    task = get_task(f"builtin:reasoning_gym/{SPEC}", "data.val_prompts")
    held = [row["rg_entry"]["question"] for row in itertools.islice(task.held_out_prompts(1_000_001), 200)]
    assert len(set(held)) == 200  # each once
    streams = [itertools.islice(task.prompts(seed), 3000) for seed in (0, 1, 1_000_001)]
    trained = {row["rg_entry"]["question"] for rows in streams for row in rows}
    assert len(trained) > 1000 and not trained & set(held)
    # about HELD_OUT_SHARE of the distinct questions drawn are held out
    drawn = [item["question"] for item in itertools.islice(rgym._items("chain_sum", {}, 5, "f"), 4000)]
    assert 0.09 < sum(map(rgym.held_out, set(drawn))) / len(set(drawn)) < 0.16


def test_validation_and_test_sets_of_one_task_are_disjoint_held_out_questions(rgym):
    spec = "builtin:reasoning_gym/chain_sum?min_terms=2&max_terms=2&max_digits=1"  # about 25 held-out questions
    data = RolloutDataModule(prompts=spec, val_prompts=spec, test_prompts=spec, val_size=10)
    val, test = ([row["rg_entry"]["question"] for row in rows] for rows in (data.val_rows, data.test_rows))
    assert len(set(val)) == len(set(test)) == 10 and not set(val) & set(test)
    assert all(map(rgym.held_out, val + test))


POLYNOMIALS = "polynomial_multiplication?min_terms=2&max_terms=2&max_value=5&max_degree=1"


def test_a_dataset_whose_problems_follow_the_hash_seed_needs_a_fixed_one(rgym, monkeypatch):
    import subprocess

    # the fact checked: polynomial_multiplication picks terms from a set of sympy symbols, so a fresh interpreter
    # with another hash seed makes other problems
    make = (
        "import reasoning_gym as rg; d = rg.create_dataset('polynomial_multiplication', seed=0, size=20, min_terms=2,"
        " max_terms=2, max_value=5, max_degree=1); print([d[i]['question'] for i in range(20)])"
    )
    made = {
        subprocess.run(
            [sys.executable, "-c", make], env={**os.environ, "PYTHONHASHSEED": str(h)}, capture_output=True, text=True
        ).stdout
        for h in range(3)
    }
    assert len(made) > 1
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(
        ConfigError, match=r"data.prompts: .*polynomial_multiplication's problems change with .*PYTHONHASHSEED=0"
    ):
        get_task(f"builtin:reasoning_gym/{POLYNOMIALS}", "data.prompts")
    assert not rgym.depends_on_hash_seed(SPEC)  # chain_sum draws from a seeded random.Random only
    get_task(f"builtin:reasoning_gym/{SPEC}", "data.prompts")
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # fixed in this process and those it starts: the same problems
    get_task(f"builtin:reasoning_gym/{POLYNOMIALS}", "data.prompts")


def test_a_problem_space_too_small_for_the_held_out_set_is_an_error(rgym):
    task = get_task("builtin:reasoning_gym/chain_sum?min_terms=2&max_terms=2&max_digits=1", "data.val_prompts")
    # 10 x 2 x 10 = 200 distinct questions, about 25 of them held out
    with pytest.raises(ConfigError, match=r"too few distinct problems; widen them or lower data.val_size"):
        list(itertools.islice(task.held_out_prompts(0), 200))


@pytest.mark.parametrize(
    "response, fmt, answer",
    [
        ("1 + 5 = 6", "final", "6"),
        ("Let me think.\nThe final answer is **-72**.", "final", "-72"),
        ("The answer: $3/4$", "final", "3/4"),
        ("The final answer to the problem is 5.", "final", "5"),
        ("It is 4 = 2 + 2 is not it", "final", "not it"),
        ("This island", "final", "This island"),
        ("a = b =", "final", None),
        ("cat", "final", "cat"),
        ("", "final", None),
        ("x <answer> 6 </answer> then <answer>7</answer>", "tags", "7"),
        ("<answer>6", "tags", None),
        ("first\n  second line  \n\n", "last_line", "second line"),
    ],
)
def test_extract(rgym, response, fmt, answer):
    assert rgym.extract(response, fmt) == answer


def test_the_datasets_own_scorer_is_the_reward_and_full_marks_the_metric(rgym):
    task = get_task(f"builtin:reasoning_gym/{SPEC}&answer_format=tags", "data.prompts")
    row = next(task.prompts(3))
    value = chain_value(row["rg_entry"]["question"])
    replies = [f"<answer>{value}</answer>", f"<answer>{value + 1}</answer>", f"= {value}"]
    replies.append(f"<answer>+{value}.00</answer>")
    columns = {k: [row[k]] * len(replies) for k in ("rg_task", "rg_entry", "answer_format")}
    # chain_sum's scorer: the number, tolerating sign, leading zeros and trailing decimals; no tags, no answer
    assert rgym.score_answer([""] * 4, replies, **columns) == [1.0, 0.0, 0.0, 1.0]
    assert rgym.solved([""] * 4, replies, **columns) == [1.0, 0.0, 0.0, 1.0]
    assert rgym.answer_format_reward([""] * 4, replies, columns["answer_format"]) == [1.0, 1.0, 0.0, 1.0]


def test_partial_credit_counts_as_reward_but_not_as_solved(rgym):
    task = get_task("builtin:reasoning_gym/letter_counting", "data.prompts")
    row = next(task.prompts(0))
    answer = row["rg_entry"]["answer"]
    columns = {k: [row[k]] for k in ("rg_task", "rg_entry", "answer_format")}
    # reasoning-gym's default scorer: the oracle inside a longer answer scores len(oracle) / len(answer)
    (partial,) = rgym.score_answer([""], [f"{answer}xy"], **columns)
    assert partial == pytest.approx(len(answer) / (len(answer) + 2)) and 0 < partial < 1
    assert rgym.solved([""], [f"{answer}xy"], **columns) == [0.0]
    assert rgym.solved([""], [answer], **columns) == [1.0]


def test_one_line_replies_follow_the_final_and_last_line_formats(rgym):
    replies = ["6", "work\n6", "", "<answer></answer>"]
    assert rgym.answer_format_reward([""] * 4, replies, ["final"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert rgym.answer_format_reward([""] * 4, replies, ["tags"] * 4) == [0.0, 0.0, 0.0, 0.0]


def test_a_reply_the_datasets_scorer_raises_on_scores_zero_with_one_warning(rgym):
    task = get_task("builtin:reasoning_gym/prime_factorization", "data.prompts")
    row = next(task.prompts(0))
    columns = {k: [row[k]] * 3 for k in ("rg_task", "rg_entry", "answer_format")}
    replies = ["The prime factors are 3", row["rg_entry"]["answer"], "prime factors: 7"]
    # prime_factorization's own scorer calls int() on each factor and raises on the first and last reply
    with pytest.warns(UserWarning, match=r"score_answer raised ValueError.* such a reply scores 0") as caught:
        assert rgym.solved([""] * 3, replies, **columns) == [0.0, 1.0, 0.0]
    assert len([w for w in caught if "score_answer raised" in str(w.message)]) == 1


def test_a_scorer_that_raises_on_the_right_answer_too_is_an_error(rgym, monkeypatch):
    row = next(get_task("builtin:reasoning_gym/prime_factorization", "data.prompts").prompts(0))
    scorer = rgym._scorer(row["rg_task"])

    def broken(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(scorer, "score_answer", broken)
    with pytest.raises(KeyError, match="metadata"):
        rgym.solved([""], [row["rg_entry"]["answer"]], [row["rg_task"]], [row["rg_entry"]], [row["answer_format"]])
