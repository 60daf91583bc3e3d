"""KL calibration of the ECs on the tiny Llama quantized with RTN at 3 bits."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_llama
from spear.compensate.calibrate import (
    CalibrateConfig,
    OnlineTeacher,
    calibrate_ecs,
    ec_modules,
    ec_parameters,
    ec_state_dict,
    load_ec_state_dict,
    mean_kl,
    norm_gains,
    teacher_topk,
)
from spear.compensate.graphed_step import GraphedStep, _copy_into
from spear.errors import SpearError
from spear.layer import ErrorCompensator, SpearLinear
from spear.quant.pipeline import QuantSettings, quantize_model
from spear.record import QuantConfig

FAST = CalibrateConfig(steps=30, batch_size=4, lr=1e-2, lr_ab=1e-3, holdout=0.25, eval_every=5, patience=100, progress=False)


def quantized_pair(rank: int = 8, gate_hidden: int = 4):
    """(teacher, student): the float tiny Llama and a 3-bit RTN copy with SVD-initialised ECs (LoRC)."""
    teacher = make_tiny_llama()
    student = copy.deepcopy(teacher)
    floats = {name: m.weight.detach().clone() for name, m in student.named_modules() if isinstance(m, torch.nn.Linear)}
    quantize_model(student, QuantSettings(method="rtn", quant=QuantConfig(bits=3)))
    torch.manual_seed(1)
    for name, m in student.named_modules():
        if isinstance(m, SpearLinear):
            u, s, vh = torch.linalg.svd(floats[name] - m.weight_hat, full_matrices=False)
            m.ec = ErrorCompensator(m.in_features, m.out_features, rank=rank, gate_hidden=gate_hidden)
            with torch.no_grad():
                m.ec.A.copy_(s[:rank, None].sqrt() * vh[:rank])
                m.ec.B.copy_(u[:, :rank] * s[:rank].sqrt())
    return teacher, student


def calib_ids(n: int = 16, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))


def naive_kl(student, teacher, ids) -> float:
    with torch.no_grad():
        t, s = teacher(ids).logits.log_softmax(-1), student(ids).logits.log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="sum").item() / ids.numel()


def frozen_tensors(model) -> dict[str, torch.Tensor]:
    ec_names = set(ec_state_dict(model))
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items() if k not in ec_names} | {
        f"{name}.weight_hat": m.weight_hat.clone() for name, m in model.named_modules() if isinstance(m, SpearLinear)
    }


def test_mean_kl_is_the_full_vocabulary_kl_in_chunks():
    teacher, student = quantized_pair()
    ids = calib_ids(4, 16)
    want = naive_kl(student, teacher, ids)
    assert want > 0
    assert mean_kl(student, teacher, ids, batch_size=3, chunk_tokens=7) == pytest.approx(want, rel=1e-4)
    # top-k with k = vocab − 1: the rest bucket is one token, so the coarsened KL is the full KL, up to the float32
    # rounding of that bucket's 1 − Σ p_top (~6e-8 on this 5e-4 KL with one thread, under 1e-4 of it with two)
    cache = teacher_topk(teacher, ids, k=255, batch_size=3, chunk_tokens=7)
    assert mean_kl(student, cache, ids, chunk_tokens=5) == pytest.approx(want, rel=1e-4, abs=2e-7)
    # fewer tokens: a lower bound
    assert mean_kl(student, teacher_topk(teacher, ids, k=8), ids) < want


def test_calibration_lowers_heldout_kl_and_changes_only_the_ecs():
    teacher, student = quantized_pair()
    before = frozen_tensors(student)
    ec_before = ec_state_dict(student)
    result = calibrate_ecs(student, teacher, calib_ids(), FAST)
    assert result.steps == 30 and len(result.history) == 6
    assert result.final_heldout_kl < 0.9 * result.initial_heldout_kl
    assert result.final_train_kl < result.initial_train_kl
    after = frozen_tensors(student)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not torch.equal(ec_before[k], v) for k, v in ec_state_dict(student).items())
    trainable = {id(p) for p in student.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in ec_parameters(student)}
    assert result.to_dict()["history"][0]["step"] == 5


def test_calibration_is_deterministic_for_a_seed():
    runs = []
    for _ in range(2):
        teacher, student = quantized_pair()
        result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, steps=10))
        runs.append((result, ec_state_dict(student)))
    (r1, s1), (r2, s2) = runs
    assert r1.final_heldout_kl == r2.final_heldout_kl and r1.best_step == r2.best_step
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_gate_switched_off_stays_identity():
    teacher, student = quantized_pair()
    gates = {k: v for k, v in ec_state_dict(student).items() if ".gate." in k}
    result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, train_gate=False))
    assert result.final_heldout_kl < result.initial_heldout_kl
    after = ec_state_dict(student)
    assert all(torch.equal(v, after[k]) for k, v in gates.items())
    ec = next(iter(ec_modules(student).values()))
    u = torch.randn(5, ec.rank)
    assert torch.equal(1 + torch.tanh(ec.gate(u)), torch.ones_like(u))  # gamma ≡ 1

    teacher, student = quantized_pair(gate_hidden=0)  # no gate at all: the static EC, calibrated
    result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, steps=15))
    assert result.final_heldout_kl < result.initial_heldout_kl
    assert all(ec.gate is None for ec in ec_modules(student).values())


def test_only_gate_and_alpha_move_without_train_ab():
    teacher, student = quantized_pair()
    ab = {k: v for k, v in ec_state_dict(student).items() if k.endswith((".A", ".B"))}
    calibrate_ecs(student, teacher, calib_ids(), replace(FAST, train_AB=False, steps=5))
    after = ec_state_dict(student)
    assert all(torch.equal(v, after[k]) for k, v in ab.items())
    assert all(after[k].item() != 1.0 for k in after if k.endswith("alpha"))


def test_early_stopping_restores_the_best_state():
    teacher, student = quantized_pair()
    initial = ec_state_dict(student)
    cfg = replace(FAST, lr=1.0, lr_ab=0.3, eval_every=2, patience=2)  # diverges
    result = calibrate_ecs(student, teacher, calib_ids(), cfg)
    assert result.steps < cfg.steps and result.best_step == 0
    assert result.final_heldout_kl == result.initial_heldout_kl
    assert all(torch.equal(initial[k], v) for k, v in ec_state_dict(student).items())


def test_norm_gains_train_beside_the_ecs_and_roll_back_with_them():
    """norm_lr > 0: every RMSNorm gain (2 per layer and the final one) moves and trains, nothing else outside the ECs
    does; the KL ends lower than with the ECs alone; a diverging run restores the gains with the ECs."""
    teacher, student = quantized_pair()
    gains = {k: v.detach().clone() for k, v in norm_gains(student).items()}
    assert len(gains) == 2 * teacher.config.num_hidden_layers + 1
    before = {k: v for k, v in frozen_tensors(student).items() if k not in gains}
    tweaked = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, norm_lr=1e-2))
    assert all(not torch.equal(gains[k], v) for k, v in norm_gains(student).items())
    assert all(torch.equal(before[k], v) for k, v in frozen_tensors(student).items() if k in before)
    trainable = {id(p) for p in student.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in ec_parameters(student)} | {id(p) for p in norm_gains(student).values()}
    _, plain_student = quantized_pair()
    plain = calibrate_ecs(plain_student, teacher, calib_ids(), FAST)
    assert tweaked.final_heldout_kl < plain.final_heldout_kl
    assert all(torch.equal(gains[k], v) for k, v in norm_gains(plain_student).items())  # norm_lr 0: untouched

    _, student = quantized_pair()
    result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, norm_lr=5.0, eval_every=2, patience=2))
    assert result.best_step == 0 and all(torch.equal(gains[k], v) for k, v in norm_gains(student).items())
    with pytest.raises(SpearError, match="norm_lr"):
        CalibrateConfig(norm_lr=-1.0)


def test_cached_topk_teacher_and_no_teacher_model():
    teacher, student = quantized_pair()
    ids = calib_ids()
    cache = teacher_topk(teacher, ids, k=32)
    result = calibrate_ecs(student, None, ids, FAST, teacher_logits=cache)
    assert result.final_heldout_kl < result.initial_heldout_kl
    assert mean_kl(student, teacher, ids) < mean_kl(quantized_pair()[1], teacher, ids)


def test_low_precision_student_is_trained_in_float32_and_restored():
    teacher, student = quantized_pair()
    student.to(torch.bfloat16)
    before = frozen_tensors(student)
    dtypes = {k: v.dtype for k, v in student.state_dict().items()}
    result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, steps=10))
    assert result.final_train_kl < result.initial_train_kl
    assert {k: v.dtype for k, v in student.state_dict().items()} == dtypes
    after = frozen_tensors(student)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bfloat16_student_trains_from_float32_masters_and_is_restored_exactly():
    teacher, student = quantized_pair()
    head = student.get_output_embeddings()
    before = frozen_tensors(student)
    dtypes = {k: v.dtype for k, v in student.state_dict().items()}
    seen = {}

    def spy(module, args):  # what the body and the head compute in, during training
        held = module.A if isinstance(module, ErrorCompensator) else module.weight
        seen.setdefault(type(module).__name__, (args[0].dtype, held.dtype))

    handles = [student.model.layers[0].mlp.down_proj.register_forward_pre_hook(spy),
               student.model.layers[0].mlp.down_proj.ec.register_forward_pre_hook(spy)]
    result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, steps=10, precision="bfloat16"))
    for h in handles:
        h.remove()
    assert result.precision == "bfloat16"
    assert seen["SpearLinear"] == (torch.bfloat16, torch.bfloat16)
    assert seen["ErrorCompensator"][1] == torch.float32  # the masters; the EC computes in the input's dtype
    assert result.final_train_kl < result.initial_train_kl
    assert student.get_output_embeddings() is head
    assert {k: v.dtype for k, v in student.state_dict().items()} == dtypes
    after = frozen_tensors(student)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(SpearError, match="float32 only"):
        CalibrateConfig(precision="bfloat16", norm_lr=1e-3)
    with pytest.raises(SpearError, match="unknown calibration precision"):
        CalibrateConfig(precision="fp8")


def test_auto_precision_is_float32_off_cuda_and_for_small_students():
    from spear.compensate.precision import training_precision

    _, student = quantized_pair()
    assert training_precision(student, CalibrateConfig().precision) == "float32"
    assert training_precision(student, "bfloat16") == "bfloat16"


def test_checkpointed_layers_recompute_and_train_alike():
    calls, states = {}, {}
    for checkpointed in (False, True):
        teacher, student = quantized_pair()
        count = [0]
        student.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        result = calibrate_ecs(student, teacher, calib_ids(), replace(FAST, steps=10, checkpoint_layers=checkpointed))
        calls[checkpointed], states[checkpointed] = count[0], (result.final_train_kl, ec_state_dict(student))
        assert all("forward" not in vars(layer) for layer in student.model.layers)  # unwrapped on exit
    assert calls[True] == calls[False] + 10  # one recompute in each training step's backward
    (kl_plain, plain), (kl_ckpt, ckpt) = states[False], states[True]
    assert kl_ckpt == pytest.approx(kl_plain, rel=1e-6)
    assert all(torch.allclose(plain[k], ckpt[k], atol=1e-7) for k in plain)


def test_ec_state_roundtrip_and_errors():
    teacher, student = quantized_pair()
    state = ec_state_dict(student)
    with torch.no_grad():
        for p in ec_parameters(student):
            p.zero_()
    load_ec_state_dict(student, state)
    assert all(torch.equal(state[k], v) for k, v in ec_state_dict(student).items())
    with pytest.raises(SpearError, match="does not fit"):
        load_ec_state_dict(student, {k: v for k, v in list(state.items())[1:]})
    with pytest.raises(SpearError, match="no error compensators"):
        calibrate_ecs(copy.deepcopy(teacher), teacher, calib_ids(), FAST)
    with pytest.raises(SpearError, match="teacher"):
        calibrate_ecs(student, None, calib_ids(), FAST)
    with pytest.raises(SpearError, match="teacher mode"):
        CalibrateConfig(teacher_mode="offline")


def test_hidden_state_term_changes_the_training_and_needs_the_online_teacher():
    """With λ > 0 the layer-matching term enters the gradient (a different trained state, still lowering the KL);
    the term's value is zero between identical models and positive otherwise."""
    from spear.compensate.calibrate import _layer_discrepancy
    from spear.models.head import last_hidden

    teacher, student = quantized_pair()
    ids = calib_ids()
    _, t_layers = last_hidden(teacher, ids[:2], True)
    _, s_layers = last_hidden(student, ids[:2], True)
    assert len(t_layers) == teacher.config.num_hidden_layers - 1
    assert _layer_discrepancy(t_layers, t_layers).item() == 0.0 < _layer_discrepancy(s_layers, t_layers).item()
    plain = copy.deepcopy(student)
    calibrate_ecs(plain, teacher, ids, FAST)
    result = calibrate_ecs(student, teacher, ids, replace(FAST, hidden_weight=1.0))
    assert result.final_heldout_kl < result.initial_heldout_kl
    assert any(not torch.equal(a, b) for a, b in zip(ec_state_dict(plain).values(), ec_state_dict(student).values()))
    with pytest.raises(SpearError, match="hidden"):
        CalibrateConfig(hidden_weight=1.0, teacher_mode="topk")


def test_gate_spread_is_zero_for_a_fresh_gate_and_positive_after_training():
    from spear.compensate.calibrate import gate_spread

    teacher, student = quantized_pair()
    ids = calib_ids()
    fresh = gate_spread(student, ids[:4])
    assert fresh["gated_ecs"] > 0 and fresh["token_std"] == 0.0 and fresh["mean_abs_deviation"] == 0.0
    calibrate_ecs(student, teacher, ids, FAST)
    trained = gate_spread(student, ids[:4])
    assert trained["token_std"] > 0 and trained["mean_abs_deviation"] > 0


def test_teacher_hidden_state_cache_trains_as_the_uncached_teacher_and_keeps_its_byte_cap():
    teacher, student = quantized_pair()
    ids = calib_ids()
    runs = {}
    for gb in (0.0, 1.0):
        s = copy.deepcopy(student)
        runs[gb] = (calibrate_ecs(s, teacher, ids, replace(FAST, teacher_cache_gb=gb)), ec_state_dict(s))
    (plain, plain_state), (cached, cached_state) = runs[0.0], runs[1.0]
    assert cached.final_heldout_kl == pytest.approx(plain.final_heldout_kl, rel=1e-4)
    for name, v in plain_state.items():
        torch.testing.assert_close(cached_state[name], v, rtol=1e-4, atol=1e-5)

    target = OnlineTeacher(teacher, cache_bytes=3 * 32 * teacher.config.hidden_size * 4)  # three rows of 32 tokens
    rows = torch.arange(4)
    h, _ = target.prepare(rows, ids[rows])
    assert sorted(target.hidden) == [0, 1, 2] and target.cached_bytes <= target.cache_bytes
    again, _ = target.prepare(torch.tensor([2, 0]), ids[[2, 0]])  # from the cache alone
    torch.testing.assert_close(again, torch.cat([h[64:96], h[:32]]))
    assert OnlineTeacher(teacher, layers=True, cache_bytes=1 << 30).cache_bytes == 0  # layer outputs are never cached


def test_heldout_share_is_capped_and_the_graphed_step_is_eager_off_cuda():
    teacher, student = quantized_pair()
    ids = calib_ids(16, 16)
    capped = calibrate_ecs(copy.deepcopy(student), teacher, ids, replace(FAST, steps=2, holdout=0.5, max_holdout=3))
    assert capped.heldout_sequences == 3
    assert calibrate_ecs(copy.deepcopy(student), teacher, ids, replace(FAST, steps=2)).heldout_sequences == 4
    # cuda_graph only applies to CUDA tensors: on CPU both settings run the same eager step
    runs = [calibrate_ecs(copy.deepcopy(student), teacher, ids, replace(FAST, steps=4, cuda_graph=g, eval_batch_size=b))
            for g, b in ((True, 3), (False, 16))]
    assert runs[0].final_heldout_kl == pytest.approx(runs[1].final_heldout_kl, rel=1e-5)
    with pytest.raises(SpearError, match="positive"):
        CalibrateConfig(eval_batch_size=0)


def test_train_kl_is_scored_on_at_most_max_holdout_training_sequences(monkeypatch):
    """The before / after train KL reads a fixed share of the training set, as the held-out scoring does."""
    import spear.compensate.calibrate as calibrate

    scored = []
    real = calibrate._mean_kl
    monkeypatch.setattr(calibrate, "_mean_kl", lambda *a: scored.append(len(a[3])) or real(*a))
    teacher, student = quantized_pair()
    result = calibrate_ecs(student, teacher, calib_ids(16, 16), replace(FAST, steps=2, holdout=0.25, max_holdout=3))
    assert result.heldout_sequences == 3 and scored and max(scored) == 3  # 13 training sequences, 3 scored


def test_graphed_step_disabled_sets_fresh_gradients_each_call():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def loss_fn(x, pair):  # runs its own backward, as calibration's _batch_loss does
        loss = (w * x).sum() + (w * pair[0] * pair[1][0]).sum()
        loss.backward()
        return loss.detach()

    step = GraphedStep(loss_fn, [w], enabled=False)
    for scale in (1.0, 3.0):  # a second call replaces the gradient, it does not accumulate
        x = torch.full((2,), scale)
        assert step(x, (x, (x,))).item() == pytest.approx(3 * (scale + scale**2))
        assert torch.allclose(w.grad, x + x * x)
    _copy_into(static := (torch.zeros(2), (torch.zeros(1),)), (torch.ones(2), (torch.full((1,), 5.0),)))
    assert static[0].tolist() == [1.0, 1.0] and static[1][0].item() == 5.0


def test_confident_positions_weigh_the_training_loss_not_the_score():
    """position_weight "confident": the training gradient is that of Σ_t w_t KL_t / T with w the teacher's top-1
    probability at mean one, for the online and the top-k teacher alike; the returned (scored) KL is the plain mean;
    a uniform weighting is the plain KL's gradient."""
    from spear.compensate.calibrate import OnlineTeacher, _batch_loss, teacher_topk

    teacher, student = quantized_pair()
    ids = calib_ids()[:2]
    params = [p for n, p in student.named_parameters() if ".ec." in n]
    for p in params:
        p.requires_grad_(True)
    for target in (OnlineTeacher(teacher), teacher_topk(teacher, ids, k=8)):
        prepared = target.prepare(torch.arange(len(ids)), ids)

        def grads(confident: bool) -> tuple[float, list[torch.Tensor]]:
            for p in params:
                p.grad = None
            kl = _batch_loss(student, target, prepared, ids, 1 << 20, True, confident=confident).item()
            return kl, [p.grad.clone() for p in params]

        kl_plain, g_plain = grads(False)
        kl_conf, g_conf = grads(True)
        assert kl_conf == pytest.approx(kl_plain, rel=1e-6)
        h = student.model(ids).last_hidden_state.flatten(0, 1)
        per_token, t_top = target.kl(student.lm_head(h), prepared, slice(None), top1=True)
        w = t_top.exp() / t_top.exp().mean()
        assert w.std() > 0.05  # the positions differ, so the weighting matters
        for p in params:
            p.grad = None
        ((w * per_token).sum() / len(per_token)).backward()
        assert all(torch.allclose(a, p.grad, rtol=1e-4, atol=1e-9) for a, p in zip(g_conf, params))
        assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(g_conf, g_plain))
    with pytest.raises(SpearError, match="position weight"):
        CalibrateConfig(position_weight="last")
