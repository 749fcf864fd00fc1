"""scripts/recipe_tasks.py: a task spec's folder name and `--set` on the recipe's settings."""

from __future__ import annotations

import pytest

import recipe_tasks


@pytest.mark.parametrize(
    "task, folder",
    [
        ("gcd?max_value=60", "gcd_60"),
        ("number_sequence", "number_sequence"),
        ("chain_sum?min_terms=2&max_terms=3&allow_negation=false", "chain_sum_2_3_f"),
        ('aiw?task_types=["siblings"]&task_type_weights=[1.0]', "aiw_siblings_1.0"),
        ('simple_equations?operators=["+", "-"]&min_value=-5', "simple_equations_-_-5"),
    ],
)
def test_a_task_spec_names_a_folder_of_plain_characters(task, folder):
    assert recipe_tasks.slug(task) == folder


def test_set_changes_or_adds_a_key_in_an_existing_section_only():
    settings = {"model": {"algorithm": {"kl_coef": 0.04}}, "data": {"val_size": 200}}
    recipe_tasks.override(settings, "model.algorithm.kl_coef=0.01")
    recipe_tasks.override(settings, "model.algorithm.dynamic_sampling=true")
    recipe_tasks.override(settings, "data.val_size=40")
    assert settings == {"model": {"algorithm": {"kl_coef": 0.01, "dynamic_sampling": True}}, "data": {"val_size": 40}}
    for bad in ("model.optimizer.lr=1", "model.algorithm.kl_coef", "model.algorithm.=3"):
        with pytest.raises(SystemExit, match="expected KEY=VALUE with KEY in a section of"):
            recipe_tasks.override(settings, bad)
