"""Prompt/response samples reach every logger: TensorBoard (an escaped markdown table), CSV (JSON lines beside the
metrics), loggers with a `log_text` table API (W&B), MLflow-like loggers (a table artifact); any other logger is
named in a one-time warning."""

import html
import json
import re
import warnings
from html.parser import HTMLParser

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugin_util import markdown_to_safe_html

from conftest import make_policy
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.training.metrics import sample_rows, samples_markdown, write_samples

TRICKY = [
    "a|b",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "```python\nprint('x|y')\n```",
    "`tick` and `` double ``",
    "ends with a backslash\\",
    "\\| an escaped pipe already, \\\\| and two backslashes",
    "__init__ *bold* _it_ [link](http://x) ![img](y)",
    "<s>not struck</s> <br> &amp; &lt; & <think>",
    "",
    "line one\n\nline three",
]


def tricky_rows() -> list[dict]:
    """Every tricky text once as a prompt and once as a response."""
    return [{"prompt": text, "response": TRICKY[-1 - i], "score": i / 4 - 1} for i, text in enumerate(TRICKY)]


# ------------------------------------------------------------------ reading the markdown back


def split_cells(line: str) -> list[str]:
    """A markdown table line's cells, split on the `|` that no backslash escapes, each without its padding."""
    cells, cell, chars = [], "", iter(line)
    for char in chars:
        if char == "\\":
            cell += char + next(chars, "")
        elif char == "|":
            cells.append(cell)
            cell = ""
        else:
            cell += char
    cells.append(cell)
    assert cells[0] == "" and cells[-1] == "", line  # the line starts and ends with a pipe
    return [c.removeprefix(" ").removesuffix(" ") for c in cells[1:-1]]


def unescape_cell(cell: str) -> str:
    """The original text of an escaped cell: backslash escapes, `<br>` line breaks, HTML entities."""
    assert "<" not in cell.replace("<br>", ""), cell  # a literal `<` would be read as HTML
    text = re.sub(r"\\(.)", r"\1", cell)
    return html.unescape(text.replace("<br>", "\n"))


def parse_table(markdown: str) -> list[list[str]]:
    header, rule, *lines = markdown.split("\n")
    assert split_cells(header) == ["prompt", "response", "score"]
    assert split_cells(rule) == ["---", "---", "---"]
    return [split_cells(line) for line in lines]


class TableCells(HTMLParser):
    """The text of each `<td>` of rendered HTML, `<br>` as a newline; any other tag inside a cell is recorded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self.markup: list[str] = []
        self.cell: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self.cell = ""
        elif self.cell is not None:
            if tag == "br":
                self.cell += "\n"
            else:
                self.markup.append(tag)

    def handle_endtag(self, tag):
        if tag == "td":
            self.rows[-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def check_table(markdown: str, rows: list[dict]) -> None:
    """Each row of the markdown has exactly 3 cells, the texts read back exactly, as raw markdown and as
    TensorBoard renders it (its markdown-to-safe-HTML)."""
    parsed = parse_table(markdown)
    assert len(parsed) == len(rows)
    for cells, row in zip(parsed, rows):
        assert len(cells) == 3, cells
        assert [unescape_cell(cells[0]), unescape_cell(cells[1])] == [row["prompt"], row["response"]]
        assert float(cells[2]) == pytest.approx(row["score"], abs=5e-4)

    rendered = TableCells()
    rendered.feed(markdown_to_safe_html(markdown))
    body = [r for r in rendered.rows if r]  # the header row has <th> cells
    assert rendered.markup == []  # no code span, emphasis, link, image or HTML from the texts
    assert body == [[row["prompt"], row["response"], f"{row['score']:.3f}"] for row in rows]


# ------------------------------------------------------------------ the pieces


def test_sample_rows_take_the_first_sample_of_each_distinct_prompt():
    prompts = [p for p in ["p0", "p1", "p2", "p3", "p4"] for _ in range(3)]  # B0 = 5 prompts, G = 3
    responses = [f"r{i}" for i in range(15)]
    scores = [float(i) for i in range(15)]
    rows = sample_rows(prompts, responses, scores, group_size=3, count=4)
    assert rows == [
        {"prompt": "p0", "response": "r0", "score": 0.0},
        {"prompt": "p1", "response": "r3", "score": 3.0},
        {"prompt": "p2", "response": "r6", "score": 6.0},
        {"prompt": "p3", "response": "r9", "score": 9.0},
    ]
    assert len(sample_rows(prompts[:6], responses[:6], scores[:6], group_size=3)) == 2  # fewer prompts than count


def test_markdown_cells_hold_any_text():
    rows = tricky_rows()
    check_table(samples_markdown(rows), rows)


# ------------------------------------------------------------------ the loggers


class QuietLogger(Logger):
    """A logger that writes no metrics (the abstract methods filled in)."""

    @property
    def name(self):
        return type(self).__name__

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class TextTableLogger(QuietLogger):
    """A logger with W&B's `log_text(key, columns, data, step)`; records its calls."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def log_text(self, key, columns=None, data=None, dataframe=None, step=None):
        self.calls.append({"key": key, "columns": columns, "data": data, "step": step})


class FakeMlflowClient:
    def __init__(self):
        self.dicts: list[tuple] = []

    def log_dict(self, run_id, dictionary, artifact_file):
        self.dicts.append((run_id, json.loads(json.dumps(dictionary)), artifact_file))


class MlflowLikeLogger(QuietLogger):
    """MLFlowLogger's public surface: `run_id` and an `experiment` (an MlflowClient) with `log_dict`."""

    def __init__(self):
        super().__init__()
        self.client = FakeMlflowClient()

    @property
    def run_id(self):
        return "run-1"

    @property
    def experiment(self):
        return self.client


class UnknownLogger(QuietLogger):
    """A logger with no text API that lit_rlhf knows."""


def test_tensorboard_and_csv_loggers_get_every_row(tmp_path):
    rows = tricky_rows()
    tensorboard = TensorBoardLogger(save_dir=tmp_path, name="tb")
    csv = CSVLogger(save_dir=tmp_path / "not" / "yet", name="csv")  # its folder does not exist yet
    write_samples([csv, tensorboard], rows, step=3)
    write_samples([csv, tensorboard], rows[:2], step=7, tag="val/samples")
    tensorboard.experiment.flush()

    events = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    texts = {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }
    assert sorted(texts) == ["samples/text_summary", "val/samples/text_summary"]
    [(step, markdown)] = texts["samples/text_summary"]
    assert step == 3
    check_table(markdown, rows)
    [(step, markdown)] = texts["val/samples/text_summary"]
    assert step == 7
    check_table(markdown, rows[:2])

    lines = (tmp_path / "not" / "yet" / "csv" / "version_0" / "samples.jsonl").read_text(encoding="utf-8")
    records = [json.loads(line) for line in lines.splitlines()]
    assert records == [{"step": 3, "tag": "samples", **row} for row in rows] + [
        {"step": 7, "tag": "val/samples", **row} for row in rows[:2]
    ]


def test_a_logger_with_log_text_gets_a_table():
    logger = TextTableLogger()
    rows = tricky_rows()
    write_samples([logger], rows, step=5)
    assert logger.calls == [
        {
            "key": "samples",
            "columns": ["prompt", "response", "score"],
            "data": [[row["prompt"], row["response"], row["score"]] for row in rows],
            "step": 5,
        }
    ]


def test_an_mlflow_like_logger_gets_a_table_artifact():
    logger = MlflowLikeLogger()
    rows = tricky_rows()[:3]
    write_samples([logger], rows, step=12)
    assert logger.client.dicts == [
        (
            "run-1",
            {
                "columns": ["prompt", "response", "score"],
                "data": [[r["prompt"], r["response"], r["score"]] for r in rows],
            },
            "samples/step_00000012.json",
        )
    ]


def test_an_unknown_logger_is_named_in_one_warning_and_the_others_still_get_samples(tmp_path):
    unknown, known = UnknownLogger(), TextTableLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            write_samples([unknown, known], tricky_rows(), step=step)
    messages = [str(w.message) for w in caught if "UnknownLogger" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "samples" in messages[0]
    assert [call["step"] for call in known.calls] == [0, 1, 2]


# ------------------------------------------------------------------ through the Trainer


def test_every_logger_of_a_fit_gets_the_samples(tokenizer, tmp_path):
    """CSV listed first, TensorBoard second, a `log_text` logger third: all three get the samples."""
    L.seed_everything(0)
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=1,
    )
    csv = CSVLogger(save_dir=tmp_path, name="csv")
    tensorboard = TensorBoardLogger(save_dir=tmp_path, name="tb")
    table = TextTableLogger()
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=[csv, tensorboard, table],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16))
    tensorboard.experiment.flush()

    records = [json.loads(line) for line in (tmp_path / "csv" / "version_0" / "samples.jsonl").read_text().splitlines()]
    # two distinct prompts per rollout, two rollouts, each at the global step after its update
    assert [r["step"] for r in records] == [1, 1, 2, 2]
    assert all(set(r) == {"step", "tag", "prompt", "response", "score"} for r in records)
    events = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("samples/text_summary")] == [1, 2]
    assert [call["step"] for call in table.calls] == [1, 2]
    assert [len(call["data"]) for call in table.calls] == [2, 2]
