"""Stage 2: continued training lowers the loss, touches only what it should, resumes exactly, stops on NaN."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.train.common import converted_layers
from raven_convert.train.data import PackedDataset, batch_iterator, rows_visited
from raven_convert.train.graphs import optimizer_mode, set_lr
from raven_convert.train.lora import is_lora, lr_groups, merge_lora, select_trainable
from raven_convert.train.losses import answer_weighted, ce_loss
from raven_convert.train.stage2 import latest_checkpoint, train
from raven_convert.train.stage2_config import TrainConfig

SETTINGS = {"sse": {"lora_rank": 8}, "sila": {}}
FAST = dict(batch_size=4, lr=3e-3, warmup_steps=2, log_every=0, save_every=1000)


def rows(n: int = 16, T: int = 16, seed: int = 0) -> PackedDataset:
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: each row counts up from a random start, so next-token loss can fall quickly
    start = torch.randint(3, 60, (n, 1), generator=g)
    ids = (start + torch.arange(T)).clamp(max=127).int()
    return PackedDataset(
        {"input_ids": ids, "document_ids": torch.zeros_like(ids), "position_ids": torch.arange(T).expand(n, T).int()}
    )


@pytest.fixture
def teacher(tiny_sources):
    return AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).eval()


def hybrid(teacher):
    return build_hybrid(teacher, plan_layers([("sse", "1"), ("sila", "2")], 4), SETTINGS)


def mean_ce(model, data) -> float:
    batch = next(batch_iterator(data, len(data), seed=0))
    with torch.no_grad():
        return ce_loss(model(batch["input_ids"]).logits, batch["input_ids"], batch["attention_mask"]).item()


def mixer_names(model) -> set[str]:
    return {
        n
        for n, _ in model.named_parameters()
        if any(n.startswith(f"model.layers.{i}.self_attn.") for i in converted_layers(model))
    }


@pytest.mark.parametrize("trainable", ["mixers", "all"])
def test_training_lowers_the_loss(teacher, tmp_path, trainable):
    student, data = hybrid(teacher), rows()
    before = mean_ce(student, data)
    history = train(student, teacher, data, TrainConfig(steps=30, trainable=trainable, **FAST), tmp_path)
    assert len(history) == 30 and [r["step"] for r in history] == list(range(1, 31))
    assert set(history[0]) == {"step", "loss", "ce", "kd", "aux", "lr", "tokens_per_second", "mfu"}
    assert history[0]["mfu"] is None  # no known peak on a CPU
    assert mean_ce(student, data) < 0.9 * before
    assert latest_checkpoint(tmp_path)[1]["step"] == 30


def test_validation_ce_is_reported_and_falls(teacher, tmp_path):
    student, data, held_out = hybrid(teacher), rows(), rows(n=6, seed=1)
    config = TrainConfig(steps=20, eval_every=10, eval_batches=2, **FAST)
    history = train(student, teacher, data, config, tmp_path, validation=held_out)
    scored = [r for r in history if "val_ce" in r]
    assert [r["step"] for r in scored] == [10, 20]
    assert scored[-1]["val_ce"] < scored[0]["val_ce"] and math.isfinite(scored[-1]["val_ce"])
    assert student.training  # validation puts the model back in training mode


def test_token_weights_and_kd_are_logged(teacher, tmp_path):
    student, data = hybrid(teacher), rows()
    w = torch.rand(len(data), data.seq_len)
    config = TrainConfig(steps=3, kd_weight=0.5, kd_temperature=2.0, token_weight_tau=100.0, **FAST)
    history = train(student, teacher, data, config, tmp_path, token_weights=w)
    assert all(r["kd"] > 0 and r["aux"] > 0 for r in history)
    for r in history:
        assert r["loss"] == pytest.approx(r["ce"] + 0.5 * r["kd"] + r["aux"], rel=1e-5)


def test_answer_tokens_weigh_answer_weight_times_in_the_ce(teacher, tmp_path, capsys):
    data = rows()
    answers = torch.zeros(len(data), data.seq_len, dtype=torch.bool)
    answers[:, 9:12] = True  # each row's answer: 3 of its 16 tokens
    data = PackedDataset(data.tensors | {"answers": answers})
    config = TrainConfig(steps=1, answer_weight=10.0, **FAST)
    student = hybrid(teacher)
    batch = next(batch_iterator(data, config.batch_size, seed=config.seed))
    logits = student.train()(batch["input_ids"], position_ids=batch["position_ids"]).logits
    weighted = ce_loss(logits, batch["input_ids"], batch["attention_mask"], answer_weighted(None, answers[:4], 10))
    plain = ce_loss(logits, batch["input_ids"], batch["attention_mask"])
    history = train(student, teacher, data, config, tmp_path)
    assert history[0]["ce"] == pytest.approx(weighted.item(), rel=1e-5) and weighted > plain
    assert "answer tokens weighted x10: 48 of the rows' 256 tokens (18.750%)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="answer_weight != 1 needs rows that mark answers"):
        train(hybrid(teacher), teacher, rows(), config, tmp_path / "unmarked")
    unanswered = PackedDataset(data.tensors | {"answers": torch.zeros_like(answers)})
    with pytest.raises(ValueError, match="none of the rows' 256 tokens is an answer"):
        train(hybrid(teacher), teacher, unanswered, config, tmp_path / "none")


def test_a_weight_table_missing_rows_this_run_reads_is_refused(teacher, tmp_path):
    student, data = hybrid(teacher), rows()
    config = TrainConfig(steps=2, **FAST)
    read = rows_visited(len(data), config.batch_size, config.seed, 2)
    w = torch.rand(len(data), data.seq_len)
    unread = torch.ones(len(data), dtype=torch.bool)
    unread[read] = False
    w[unread] = float("nan")  # as weight_table(only=read) leaves them: this run still trains
    train(student, teacher, data, config, tmp_path / "ok", token_weights=w)
    w[read[0]] = float("nan")
    with pytest.raises(ValueError, match=rf"no weights for 1 of the {len(read)} rows this run reads \(rows \["):
        train(student, teacher, data, config, tmp_path / "missing", token_weights=w)


def test_train_prints_tau_as_a_share_of_the_run(teacher, tmp_path, capsys):
    data = rows()
    config = TrainConfig(steps=3, token_weight_tau_fraction=0.5, **FAST)
    train(hybrid(teacher), teacher, data, config, tmp_path, token_weights=torch.rand(len(data), data.seq_len))
    tau = 0.5 * 3 * config.batch_size * data.seq_len
    assert f"tau = {tau:,.0f} tokens (0.5 of the run's {2 * tau:,.0f})" in capsys.readouterr().err


@pytest.mark.parametrize("trainable", ["mixers", "mixers+lora"])
def test_only_the_chosen_parameters_change(teacher, tmp_path, trainable):
    student = hybrid(teacher)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    train(student, teacher, rows(), TrainConfig(steps=3, trainable=trainable, **FAST), tmp_path)
    names = dict(student.named_parameters())
    mixers = mixer_names(student)
    lora = {n for n in names if is_lora(n)}
    assert bool(lora) == (trainable == "mixers+lora")
    assert all("layers.1." not in n and "layers.2." not in n for n in lora)  # adapters only on kept layers
    for n, p in names.items():
        if n in lora:
            continue
        base = n.replace(".base_layer.", ".")
        assert base in before, n
        changed = not torch.equal(p, before[base])
        assert changed == (n in mixers), n
    if lora:  # lora_B starts at 0, so it moving means the adapters learnt
        assert any(p.abs().sum() > 0 for n, p in names.items() if "lora_B" in n)


def test_pretrained_weights_train_at_their_share_of_the_rate(teacher, tmp_path):
    """pretrained_lr_scale: at step 1 (same gradients, Adam's first step moves each weight by about the rate) the
    mixers move as at the full rate and every pretrained weight by that share of it; set_lr keeps the shares, in
    place where a graph reads the rate as a tensor."""
    config = dict(schedule="constant", trainable="all", **{**FAST, "warmup_steps": 0})
    moved = {}
    for scale in (1.0, 0.1):
        student = hybrid(teacher)
        before = {n: p.detach().clone() for n, p in student.named_parameters()}
        train(
            student, teacher, rows(), TrainConfig(steps=1, pretrained_lr_scale=scale, **config), tmp_path / f"{scale}"
        )
        moved[scale] = {n: p.detach() - before[n] for n, p in student.named_parameters()}
    mixers = mixer_names(hybrid(teacher))
    assert mixers and len(mixers) < len(moved[1.0])
    for n, full in moved[1.0].items():
        expected = full if n in mixers else 0.1 * full
        torch.testing.assert_close(moved[0.1][n], expected, rtol=1e-3, atol=2e-7, msg=n)  # fp32 steps of weights near 1
    assert any(moved[1.0][n].abs().max() > 0 for n in mixers)

    student = hybrid(teacher)
    settings = TrainConfig(steps=1, pretrained_lr_scale=0.1, **config)
    select_trainable(student, settings)
    optimizer = torch.optim.AdamW(lr_groups(student, settings), lr=settings.lr)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([3e-3, 3e-4])
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {
        id(p) for n, p in student.named_parameters() if n in mixers
    }
    one = lr_groups(student, TrainConfig(steps=1, trainable="all"))  # at scale 1 one group, as older checkpoints hold
    assert len(one) == 1 and len(one[0]["params"]) == len(list(student.parameters()))
    optimizer_mode(optimizer, graphs=True, device="cpu")
    set_lr(optimizer, 0.5)
    assert [g["lr"].item() for g in optimizer.param_groups] == pytest.approx([0.5, 0.05])


def test_resume_continues_exactly(teacher, tmp_path):
    config = dict(schedule="constant", **{**FAST, "save_every": 5})
    a = hybrid(teacher)
    train(a, teacher, rows(), TrainConfig(steps=10, **config), tmp_path / "a")
    b = hybrid(teacher)
    first = train(b, teacher, rows(), TrainConfig(steps=5, **config), tmp_path / "b")
    c = hybrid(teacher)  # a fresh process: everything comes from the checkpoint
    second = train(c, teacher, rows(), TrainConfig(steps=10, **config), tmp_path / "b")
    assert [r["step"] for r in first + second] == list(range(1, 11))
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    assert latest_checkpoint(tmp_path / "b")[1]["tokens_seen"] == 10 * 4 * 16


def test_nan_raises_before_any_update_or_checkpoint(teacher, tmp_path):
    student = hybrid(teacher)
    with torch.no_grad():
        student.model.layers[2].self_attn.v_proj.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"not finite at step 1 "):
        train(student, teacher, rows(), TrainConfig(steps=3, **{**FAST, "save_every": 1}), tmp_path)
    assert latest_checkpoint(tmp_path) is None


def test_nan_token_weight_at_a_later_step(teacher, tmp_path):
    student = hybrid(teacher)
    calls = []

    def weights(batch):
        calls.append(1)
        w = torch.zeros(batch["input_ids"].shape)
        return w + (float("nan") if len(calls) == 3 else 0.0)

    with pytest.raises(FloatingPointError, match=r"loss not finite at step 3 \(ce\)"):
        train(student, teacher, rows(), TrainConfig(steps=5, **{**FAST, "save_every": 1}), tmp_path, weights)
    assert latest_checkpoint(tmp_path)[1]["step"] == 2


def test_lora_resumes_and_merges_into_plain_weights(teacher, tmp_path):
    config = dict(
        trainable="mixers+lora", schedule="constant", gradient_checkpointing=True, **{**FAST, "save_every": 2}
    )
    a = hybrid(teacher)
    train(a, teacher, rows(), TrainConfig(steps=4, **config), tmp_path / "a")
    b = hybrid(teacher)
    train(b, teacher, rows(), TrainConfig(steps=2, **config), tmp_path / "b")
    c = hybrid(teacher)
    train(c, teacher, rows(), TrainConfig(steps=4, **config), tmp_path / "b")
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)
    ids = rows()[0]["input_ids"][None]
    a.eval()
    with torch.no_grad():
        before = a(ids).logits
        merge_lora(a)
        after = a(ids).logits
    assert not any(is_lora(n) for n, _ in a.named_parameters())
    assert set(a.state_dict()) == set(hybrid(teacher).state_dict())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_stages_with_different_mixed_precision_run_in_one_process(teacher, tmp_path):
    # a recipe's train without mixed precision, then its extend with bf16 (accelerate keeps one state per process)
    student, data = hybrid(teacher), rows()
    train(student, teacher, data, TrainConfig(steps=1, **FAST), tmp_path / "train")
    history = train(student, teacher, data, TrainConfig(steps=1, mixed_precision="bf16", **FAST), tmp_path / "extend")
    assert math.isfinite(history[0]["loss"])
