"""`speculant train data` (chat prompts + the target's own answers) and drafters trained on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.training.data import (  # noqa: E402
    ANSWERS_DIR, DataSettings, chat_ids, done_batches, generate_data, read_answers,
)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    from speculant.testing.tiny import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp("chat_target"), planted=2.0)
    (path / "chat_template.jinja").write_text(CHATML)
    return path


def settings(target, out, **kw) -> DataSettings:
    return DataSettings(target=target, out=out, **{"prompts": 10, "held_out": 4, "seed": 3, "batch": 4,
                                                   "max_new_tokens": 12, "dtype": "float32", **kw})


@pytest.fixture(scope="module")
def full_run(chat_target, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("data_full")
    generate_data(settings(chat_target, out), command=["test"])
    return out


def batch_bytes(folder) -> list[bytes]:
    return [p.read_bytes() for p in sorted((folder / ANSWERS_DIR).iterdir())]


def test_held_out_prompts_share_no_prompt_or_subject_with_training(full_run, chat_target):
    from transformers import AutoTokenizer

    prompts = json.loads((full_run / "prompts.json").read_text())
    train, held = prompts["train"], prompts["held_out"]
    assert len(train) == 10 and len(held) == 4
    assert not {p["text"] for p in train} & {p["text"] for p in held}
    assert not {p["group"] for p in train} & {p["group"] for p in held}
    data = read_answers(full_run)
    assert len(data.sequences) == 10 and done_batches(full_run) == 3  # 4 + 4 + 2
    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    for row, prompt in enumerate(train):  # each row is its training prompt's chat ids, then an answer
        ids = chat_ids(tokenizer, prompt["text"])
        assert data.sequences[row, : len(ids)].tolist() == ids and data.prompt_lengths[row] == len(ids)
        assert 1 <= data.answer_lengths[row] <= 12
    manifest = json.loads((full_run / "manifest.json").read_text())
    assert manifest["answers"] == 10 and manifest["seed"] == 3 and manifest["command"] == "test"
    assert manifest["answers_cut_at_max_new_tokens"] == int((data.answer_lengths == 12).sum())
    assert "PSF" in manifest["licences"]["stdlib_docstrings"] and "Apache-2.0" in manifest["licences"]["answers"]


def test_answers_are_the_targets_greedy_continuations(full_run, chat_target):
    """Left-padded batched generation gives what the target says to each prompt alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(chat_target), dtype=torch.float32)
    data = read_answers(full_run)
    for row in (0, 5, 9):
        prompt = torch.tensor([data.sequences[row, : data.prompt_lengths[row]].tolist()])
        alone = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=0, pad_token_id=0)
        answer = data.sequences[row, data.prompt_lengths[row] : data.lengths[row]].tolist()
        assert alone[0, prompt.shape[1]:].tolist()[: len(answer)] == answer


def test_a_stopped_run_continues_where_it_stopped_and_matches_one_run(full_run, chat_target, tmp_path):
    out = tmp_path / "data"
    generate_data(settings(chat_target, out, max_batches=1))
    first = out / ANSWERS_DIR / "batch-00000.safetensors"
    assert done_batches(out) == 1
    stamp = first.stat().st_mtime_ns
    generate_data(settings(chat_target, out))
    assert first.stat().st_mtime_ns == stamp  # continued, not restarted
    assert batch_bytes(out) == batch_bytes(full_run)  # and deterministic for the seed
    assert (out / "prompts.json").read_text() == (full_run / "prompts.json").read_text()


def test_a_restart_with_other_flags_is_refused(full_run, chat_target):
    with pytest.raises(SystemExit, match="prompts.json was made with"):
        generate_data(settings(chat_target, full_run, seed=4))
    with pytest.raises(SystemExit, match="max_new_tokens"):
        generate_data(settings(chat_target, full_run, max_new_tokens=20))


def test_another_seed_draws_other_prompts(chat_target, tmp_path):
    from speculant.training.data import write_prompts

    a = write_prompts(tmp_path, 0, 50, 8)
    (tmp_path / "prompts.json").unlink()
    b = write_prompts(tmp_path, 1, 50, 8)
    assert [p["text"] for p in a["train"]] != [p["text"] for p in b["train"]]


def test_anchors_stay_in_the_answers(full_run):
    from speculant.training.dflash import anchor_batch, anchor_rows

    data = read_answers(full_run)
    rows = anchor_rows(data.sequences, data.prompt_lengths, 4, data.lengths)
    for step in range(20):
        ids, anchors = anchor_batch(rows, step, 0, seed=0, batch=3, anchors_per_sequence=4)
        for row_ids, row_anchors in zip(ids.tolist(), anchors):
            row = next(i for i, s in enumerate(data.sequences.tolist()) if s[: len(row_ids)] == row_ids)
            assert int(row_anchors.min()) >= data.prompt_lengths[row] - 1  # blocks predict answer tokens only
            assert int(row_anchors.max()) + 4 <= data.lengths[row]  # never padding
        assert ids.shape[1] <= data.sequences.shape[1]


def test_cli_trains_dflash2_and_dflash_on_data_and_evaluates_held_out_prompts(full_run, chat_target, tmp_path, capsys):
    from speculant.cli import main

    torch.set_num_threads(1)
    common = ["--target", str(chat_target), "--data", str(full_run), "--block-size", "4", "--layers", "1",
              "--features", "2", "--anchors", "4", "--steps", "2", "--batch", "2", "--fp32", "--checkpoint-every", "2"]
    assert main(["train", "dflash", "--out", str(tmp_path / "dflash"), *common]) == 0
    assert main(["train", "dflash2", "--out", str(tmp_path / "dflash2"), "--selector-rank", "8", "--selector-top-k", "4",
                 "--init-from", str(tmp_path / "dflash"), *common]) == 0
    info = json.loads((tmp_path / "dflash2" / "training.json").read_text())
    assert info["data"]["answers"] == 10 and info["data"]["folder"] == full_run.name
    assert info["sequences"] == 10 and "sequences_file" not in info
    capsys.readouterr()
    assert main(["train", "evaluate", "--target", str(chat_target), "--draft", str(tmp_path / "dflash2"),
                 "--drafter", "dflash2", "--data", str(full_run), "--max-new-tokens", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 4 and result["mean_acceptance_length"] >= 1.0
    (tmp_path / "eval.json").write_text(json.dumps(result))
    shipped = tmp_path / "shipped"
    assert main(["train", "export", "--draft", str(tmp_path / "dflash2"), "--out", str(shipped),
                 "--evaluation", str(tmp_path / "eval.json")]) == 0
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(str(shipped / "model.safetensors")).values()} == {torch.bfloat16}
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["evaluation"]["prompts"] == 4 and manifest["data"]["answers"] == 10
    assert manifest["training"]["init_from"] == "dflash"
    import speculant

    engine = speculant.load_engine({"target": {"path": str(chat_target)}, "drafter": {"kind": "dflash2", "path": str(shipped)}})
    assert engine.run(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True).stats.new_tokens == 6


def test_mask_token_id_flag_for_a_tokenizer_without_mask(chat_target, tmp_path):
    from speculant.training.dflash import mask_token_id

    assert mask_token_id(chat_target, chosen=3) == 3
    with pytest.raises(ValueError, match="--mask-token-id 100000"):
        mask_token_id(chat_target, chosen=100000)


def test_sampled_rounds_add_seeded_sampled_answers_after_the_greedy_ones(full_run, chat_target, tmp_path):
    out = tmp_path / "sampled"
    manifest = generate_data(settings(chat_target, out, sampled_rounds=1))
    greedy = batch_bytes(full_run)
    both = batch_bytes(out)
    assert len(both) == 2 * len(greedy)
    assert both[: len(greedy)] == greedy  # round 0 is the greedy data, unchanged
    assert manifest["answers"] == 2 * json.loads((full_run / "manifest.json").read_text())["answers"]
    assert "1 sampled answer(s) per prompt at temperature 0.8" in manifest["made_by"]
    data = read_answers(out)
    half = len(data.lengths) // 2
    assert not np.array_equal(data.sequences[:half], data.sequences[half:])  # sampling wrote other answers
    again = tmp_path / "again"
    generate_data(settings(chat_target, again, sampled_rounds=1))
    assert batch_bytes(again) == both  # seeded: the same answers on a rerun


def test_max_seconds_stops_after_a_batch_and_a_rerun_continues(full_run, chat_target, tmp_path):
    out = tmp_path / "timed"
    generate_data(settings(chat_target, out, max_seconds=0))
    assert done_batches(out) == 1
    generate_data(settings(chat_target, out))
    assert batch_bytes(out) == batch_bytes(full_run)
