"""Hugging Face ``datasets`` as a data source, as TRL users give one: a ``save_to_disk`` folder (a DatasetDict's
split picked by ``data.train_split``/``data.val_split``), a folder of a dataset's data files (a Hub repository's
layout), and a Hub id that cannot be reached, refused in one line before anything trains. Each source must give
exactly the examples its rows give as a JSONL file (the reader every other test checks)."""

from __future__ import annotations

import json

import datasets
import huggingface_hub
import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.testing import build_tiny_tokenizer
from drivetrain_roles.jobs.data import load_examples, read_rows
from drivetrain_roles.jobs.dataset_rows import DatasetSourceError
from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
from drivetrain_roles.preference.config import PairDataConfig
from drivetrain_roles.preference.data import load_pairs
from drivetrain_roles.sft.config import DataConfig


def conversation(index: int) -> list[dict[str, str]]:
    """A Capybara-shaped conversation: a system prompt and two exchanges whose answers follow from the index."""
    return [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": f"hello {index}"},
        {"role": "assistant", "content": f"world {index}"},
        {"role": "user", "content": "the answer?"},
        {"role": "assistant", "content": f"is {7 * index}"},
    ]


TRAIN = [{"messages": conversation(i)} for i in range(6)]
TEST = [{"messages": conversation(i)} for i in range(6, 9)]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No Hub, and the datasets cache in the test's folder."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


def test_a_saved_dataset_dict_gives_each_split_the_examples_of_its_rows(tmp_path) -> None:
    folder = str(tmp_path / "capybara")
    splits = {"train": TRAIN, "test": TEST}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(folder)
    tokenizer, config = build_tiny_tokenizer(), DataConfig(messages_key="messages", max_length=256)
    expected_train = load_examples([jsonl(tmp_path / "train.jsonl", TRAIN)], tokenizer, config)
    expected_test = load_examples([jsonl(tmp_path / "test.jsonl", TEST)], tokenizer, config)
    assert load_examples([folder], tokenizer, config) == expected_train
    assert load_examples([folder], tokenizer, config, held_out=True) == expected_test
    assert [e.response_text for e in expected_test] == ["is 42", "is 49", "is 56"]
    with pytest.raises(DatasetSourceError, match=r"splits \['test', 'train'\], without 'validation'; set"):
        load_examples(
            [folder], tokenizer, DataConfig(messages_key="messages", val_split="validation"), held_out=True
        )


def test_a_saved_dataset_and_a_folder_of_data_files_read_as_their_rows(tmp_path) -> None:
    """A single saved ``Dataset`` has no splits; a clone of a Hub dataset repository names them by file."""
    pairs = [{"prompt": f"{i}+2=", "chosen": str(i + 2), "rejected": str(i + 3)} for i in range(5)]
    saved = str(tmp_path / "pairs")
    datasets.Dataset.from_list(pairs).save_to_disk(saved)
    tokenizer, config = build_arithmetic_tokenizer(), PairDataConfig(val_split="anything")
    expected = load_pairs([jsonl(tmp_path / "pairs.jsonl", pairs)], tokenizer, config)
    assert (
        load_pairs([saved], tokenizer, config)
        == load_pairs([saved], tokenizer, config, held_out=True)
        == expected
    )
    clone = tmp_path / "clone"
    clone.mkdir()
    jsonl(clone / "train.jsonl", TRAIN)
    jsonl(clone / "test.jsonl", TEST)
    assert read_rows(clone, split="test") == TEST and read_rows(clone) == TRAIN


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_hub_id_that_cannot_be_reached_is_one_line_naming_the_supported_forms(tmp_path, command) -> None:
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli,
        [
            command,
            "--output-dir",
            str(run_dir),
            "data.train_files=[trl-lib/Capybara]",
            "trainer.total_steps=2",
        ],
    )
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith(
        "Error: data source 'trl-lib/Capybara' (split 'train') could not be loaded with datasets: ConnectionError: "
        "Couldn't reach 'trl-lib/Capybara' on the Hub (OfflineModeIsEnabled)."
    )
    assert "folders written by datasets' save_to_disk" in line and "Hugging Face Hub dataset ids" in line
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_dpo_reads_each_split_of_a_saved_dataset_dict_for_its_warm_start_and_pairs(tmp_path) -> None:
    """The warm start's SFT rows come from the split each file list names: the chosen sides of train and test."""
    train = [
        {"prompt": f"{i}+{j}=", "chosen": str(i + j), "rejected": str(i + j + 1)}
        for i in range(8)
        for j in range(4)
    ]
    test = [{"prompt": f"{i}+9=", "chosen": str(i + 9), "rejected": str(i + 8)} for i in range(6)]
    folder = str(tmp_path / "pairs")
    splits = {"train": train, "test": test}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(folder)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli,
        [
            "dpo",
            "--output-dir",
            str(run_dir),
            f"data.train_files=[{folder}]",
            f"data.val_files=[{folder}]",
            *(
                "warm_start.sft_steps=1",
                "warm_start.batch_size=8",
                "trainer.total_steps=1",
                "trainer.batch_size=8",
            ),
            *("trainer.eval_samples=2", "trainer.progress_bar=false"),
        ],
    )
    assert result.exit_code == 0, result.output
    for name, rows in (("sft_train_0", train), ("sft_val_0", test)):
        written = [json.loads(line) for line in (run_dir / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert written == [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows]
