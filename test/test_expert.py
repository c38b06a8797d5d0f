"""Action expert: checkpoint layout, positions and mask invariants, exact parity with
transformers' Qwen3VLTextModel run the way upstream runs its expert (cache + 4D mask), and the
paged fast path against that reference, and the fused q/k/v weight (one GEMM, upstream's
parameters as views of it).

Over 400 lines: the cases share this file's helpers (the transformers reference model, its
prefill, random caches) and are one unit's parity story; a split would only move the helpers."""

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode
from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

from alpamayo_ros.core.backbone import PrefixCache
from alpamayo_ros.core.checkpoint import load_expert
from alpamayo_ros.core.config import AlpamayoConfig
from alpamayo_ros.core.expert import ActionExpertModel, ExpertConfig, MRotaryEmbedding
from alpamayo_ros.core.expert_action import FourierFeatures
from alpamayo_ros.core.expert_attention import PAGE
from alpamayo_ros.core.expert_prefix import build_positions_and_mask

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
SECTION = (2, 3, 3)  # sums to HEAD_DIM / 2
ROPE_THETA = 10_000.0
MIN = torch.finfo(torch.float32).min
W = 64  # action tokens


def tiny_config(**overrides) -> ExpertConfig:
    sizes = dict(
        hidden_size=HIDDEN, intermediate_size=96, num_layers=LAYERS, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=ROPE_THETA, mrope_section=SECTION,
        action_hidden_size=32,
    )
    return ExpertConfig(**{**sizes, **overrides})


def reference_model() -> Qwen3VLTextModel:
    """A random transformers Qwen3-VL text decoder with the tiny expert's sizes."""
    config = Qwen3VLTextConfig(
        vocab_size=16, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rope_parameters={
            "rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": list(SECTION),
            "mrope_interleaved": True,
        },
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3VLTextModel(config).eval()


def expert_from(reference: Qwen3VLTextModel) -> ActionExpertModel:
    torch.manual_seed(1)
    model = ActionExpertModel(tiny_config()).eval()
    weights = {k: v for k, v in reference.state_dict().items() if not k.startswith("embed_tokens")}
    model.expert.load_state_dict(weights, strict=True)
    return model


def prefill(reference: Qwen3VLTextModel, rows: int, length: int, seed: int = 0):
    """Run a random 'prompt' through the reference; return its cache and a copy of its K/V.

    Prefix positions differ per M-RoPE axis, as image tokens' do.
    """
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(rows, length, HIDDEN, generator=g)
    positions = torch.randint(0, 40, (3, rows, length), generator=g)
    with torch.no_grad():
        cache = reference(inputs_embeds=embeds, position_ids=positions, use_cache=True).cache
    keys = [layer.keys.clone() for layer in cache.layers]
    values = [layer.values.clone() for layer in cache.layers]
    return cache, keys, values


def prefix_cache(keys, values, offsets, deltas, valid=None) -> PrefixCache:
    return PrefixCache(
        keys=keys, values=values, offsets=torch.tensor(offsets), rope_deltas=torch.tensor(deltas),
        valid=valid,
    )


def random_cache(rows: int, length: int, seed: int, **kwargs) -> PrefixCache:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, KV_HEADS, length, HEAD_DIM)
    keys = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(shape, generator=g) for _ in range(LAYERS)]
    return prefix_cache(keys, values, **kwargs)


def noisy_action(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, W, 2, generator=g), torch.rand(rows, generator=g)


def test_state_dict_matches_upstream_checkpoint_names_and_shapes():
    model = ActionExpertModel(tiny_config())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {"expert.norm.weight": (HIDDEN,)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        layer = f"expert.layers.{i}."
        expected |= {
            layer + "self_attn.q_proj.weight": (q, HIDDEN),
            layer + "self_attn.k_proj.weight": (kv, HIDDEN),
            layer + "self_attn.v_proj.weight": (kv, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, q),
            layer + "self_attn.q_norm.weight": (HEAD_DIM,),
            layer + "self_attn.k_norm.weight": (HEAD_DIM,),
            layer + "mlp.gate_proj.weight": (96, HIDDEN),
            layer + "mlp.up_proj.weight": (96, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, 96),
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
        }
    trunk = "action_in_proj.encoder.trunk."
    linears = {0: (32, 60), 3: (32, 32), 6: (32, 32), 9: (32, 32), 12: (HIDDEN, 32)}
    for index, shape in linears.items():
        expected |= {f"{trunk}{index}.weight": shape, f"{trunk}{index}.bias": (shape[0],)}
    expected |= {f"{trunk}{index}.weight": (32,) for index in (2, 5, 8, 11)}
    expected |= {
        "action_in_proj.norm.weight": (HIDDEN,), "action_in_proj.norm.bias": (HIDDEN,),
        "action_out_proj.weight": (2, HIDDEN), "action_out_proj.bias": (2,),
    }
    assert shapes == expected


def test_positions_follow_offset_and_rope_delta_on_all_axes():
    cache = random_cache(3, 30, seed=0, offsets=[30, 12, 25], deltas=[-162, 0, 7])
    positions, _ = build_positions_and_mask(cache, W)
    assert positions.shape == (3, 3, W) and positions.dtype == torch.int64
    j = torch.arange(W)
    for row, base in enumerate([30 - 162, 12, 25 + 7]):
        for axis in range(3):
            assert torch.equal(positions[axis, row], j + base)


def test_mask_blocks_exactly_the_stop_gap_and_padding():
    valid = torch.ones(3, 30, dtype=torch.bool)
    valid[1, :4] = False  # left padding of row 1
    cache = random_cache(3, 30, seed=0, offsets=[30, 12, 25], deltas=[0, 0, 0], valid=valid)
    _, mask = build_positions_and_mask(cache, W)
    assert mask.shape == (3, 1, W, 30 + W) and mask.dtype == torch.float32
    blocked = {0: set(), 1: set(range(0, 4)) | set(range(12, 30)), 2: set(range(25, 30))}
    for row, columns in blocked.items():
        expected = torch.zeros(30 + W)
        expected[sorted(columns)] = MIN
        assert torch.equal(mask[row, 0], expected.expand(W, -1)), row


def run_stack(model, embeds, positions, mask, keys, values):
    """The decoder stack on upstream's inputs (positions, 4D mask, cache K/V)."""
    rope, kv_layers = model.expert.reference_inputs(positions, mask, keys, values, embeds.dtype)
    return model.expert(embeds, rope, kv_layers)


def test_expert_layers_match_transformers_qwen3vl():
    # Upstream runs expert(inputs_embeds, position_ids (3,N,64), past_key_values=cache,
    # attention_mask 4D, is_causal=False). Ours must give the same hidden states.
    reference = reference_model()
    model = expert_from(reference)
    rows, length = 3, 40
    cache, keys, values = prefill(reference, rows, length)
    valid = torch.ones(rows, length, dtype=torch.bool)
    valid[2, :5] = False
    ours_cache = prefix_cache(keys, values, offsets=[40, 31, 36], deltas=[-9, 0, 4], valid=valid)
    positions, mask = build_positions_and_mask(ours_cache, W)
    embeds = torch.randn(rows, W, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(
            inputs_embeds=embeds, position_ids=positions, attention_mask=mask, cache=cache,
            use_cache=True, is_causal=False,
        ).last_hidden_state
        ours = run_stack(model, embeds, positions, mask, keys, values)
    assert ours.shape == (rows, W, HIDDEN)
    assert (ours - expected).abs().max() < 1e-5
    # Guard against a vacuous comparison: the mask and positions really change the output.
    with torch.no_grad():
        unmasked = run_stack(model, embeds, positions, torch.zeros_like(mask), keys, values)
        shifted = run_stack(model, embeds, positions + 3, mask, keys, values)
    assert (unmasked - expected).abs().max() > 1e-3
    assert (shifted - expected).abs().max() > 1e-3


def test_velocity_equals_projections_around_transformers_expert():
    reference = reference_model()
    model = expert_from(reference)
    cache, keys, values = prefill(reference, 2, 24, seed=2)
    ours_cache = prefix_cache(keys, values, offsets=[24, 20], deltas=[-3, 2])
    x, t = noisy_action(2, seed=3)
    positions, mask = build_positions_and_mask(ours_cache, W)
    with torch.no_grad():
        hidden = reference(
            inputs_embeds=model.action_in_proj(x, t), position_ids=positions, attention_mask=mask,
            cache=cache, use_cache=True, is_causal=False,
        ).last_hidden_state
        expected = model.action_out_proj(hidden)
        velocity = model.velocity(x, t, ours_cache)
    assert velocity.shape == (2, W, 2)
    assert (velocity - expected).abs().max() < 1e-5


def test_rotary_matches_transformers_at_release_sizes():
    # Release head_dim 128 with mrope_section (24, 20, 20), positions differing per axis.
    ours = MRotaryEmbedding(head_dim=128, theta=5_000_000.0, section=(24, 20, 20))
    reference = Qwen3VLTextModel(
        Qwen3VLTextConfig(
            vocab_size=16, hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=128,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        )
    ).rotary_emb
    positions = torch.randint(0, 5000, (3, 2, 9), generator=torch.Generator().manual_seed(0))
    expected_cos, expected_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = ours(positions, torch.float32)
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    # A bf16 cast of the module must not round the frequencies (only the output is bf16).
    cos, sin = ours.bfloat16()(positions, torch.bfloat16)
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(cos, expected_cos.bfloat16()) and torch.equal(sin, expected_sin.bfloat16())


def test_masked_cache_columns_cannot_influence_the_velocity():
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[0, :3] = False
    cache = random_cache(2, 30, seed=1, offsets=[26, 30], deltas=[0, 0], valid=valid)
    x, t = noisy_action(2, seed=2)
    with torch.no_grad():
        before = model.velocity(x, t, cache)
        for layer in range(LAYERS):  # scribble over row 0's blocked columns only
            for tensor in (cache.keys[layer], cache.values[layer]):
                tensor[0, :, :3] = 50.0
                tensor[0, :, 26:] = -50.0
        after = model.velocity(x, t, cache)
        cache.values[0][0, :, 10] += 1.0  # an attended column does matter
        changed = model.velocity(x, t, cache)
    assert torch.equal(before, after)
    assert (changed[0] - before[0]).abs().max() > 1e-4
    assert torch.equal(changed[1], before[1])  # rows never see each other


def test_action_tokens_attend_bidirectionally():
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    cache = random_cache(1, 10, seed=1, offsets=[10], deltas=[0])
    x, t = noisy_action(1, seed=2)
    later = x.clone()
    later[0, -1] += 1.0  # change only the last waypoint
    with torch.no_grad():
        delta = model.velocity(later, t, cache) - model.velocity(x, t, cache)
    assert delta[0, 0].abs().max() > 1e-5  # the first token sees the last one


def test_velocity_leaves_the_cache_untouched_and_rows_independent():
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    cache = random_cache(3, 20, seed=1, offsets=[20, 17, 19], deltas=[1, 2, 3])
    snapshot = [k.clone() for k in cache.keys] + [v.clone() for v in cache.values]
    x, t = noisy_action(3, seed=2)
    with torch.no_grad():
        batched = model.velocity(x, t, cache)
        single = model.velocity(
            x[1:2], t[1:2],
            prefix_cache([k[1:2] for k in cache.keys], [v[1:2] for v in cache.values], [17], [2]),
        )
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.keys + cache.values))
    assert len(cache.keys[0][0, 0]) == 20
    assert (batched[1:2] - single).abs().max() < 1e-6


def test_fourier_features_layout_and_bf16_frequencies():
    features = FourierFeatures(num_feats=20, max_freq=100.0)
    assert torch.allclose(features.freqs, torch.logspace(0, 2, 10))
    encoded = features(torch.tensor([0.25]))
    assert encoded.shape == (1, 20)
    # f = 1 at x = 0.25: sin(pi/2) = 1 and cos(pi/2) = 0, both times sqrt(2).
    assert encoded[0, 0] == pytest.approx(math.sqrt(2), abs=1e-6)
    assert encoded[0, 10] == pytest.approx(0.0, abs=1e-6)
    # Upstream's bf16 load rounds the frequencies (model_facts.md section 10) but the
    # features stay fp32.
    features.bfloat16()
    assert features.freqs[1].item() == 1.671875
    assert features(torch.tensor([0.25])).dtype == torch.float32
    saved = ActionExpertModel(tiny_config()).state_dict()
    assert not any(name.endswith("freqs") for name in saved)


def test_bf16_expert_runs_close_to_fp32_on_the_same_weights():
    torch.manual_seed(0)
    half = ActionExpertModel(tiny_config()).eval().bfloat16()
    full = ActionExpertModel(tiny_config()).eval()
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    full.action_in_proj.fourier.freqs.copy_(half.action_in_proj.fourier.freqs)
    cache = random_cache(2, 16, seed=1, offsets=[16, 12], deltas=[0, 0])
    cache = prefix_cache(
        [k.bfloat16() for k in cache.keys], [v.bfloat16() for v in cache.values], [16, 12], [0, 0]
    )
    x, t = noisy_action(2, seed=2)
    with torch.no_grad():
        expected = full.velocity(x, t, cache)
        velocity = half.velocity(x, t, cache)
    assert velocity.dtype == torch.bfloat16
    assert (velocity.float() - expected).abs().max() < 0.05 * expected.abs().max()


def test_bad_config_and_inputs_are_named():
    with pytest.raises(ValueError, match="mrope_section"):
        tiny_config(mrope_section=(4, 2, 2), head_dim=32)
    with pytest.raises(ValueError, match="num_heads"):
        tiny_config(num_heads=3)
    with pytest.raises(ValueError, match="mrope_interleaved"):
        tiny_config(mrope_interleaved=False)
    model = ActionExpertModel(tiny_config())
    cache = random_cache(2, 8, seed=0, offsets=[8, 8], deltas=[0, 0])
    x, t = noisy_action(2, seed=1)
    with pytest.raises(ValueError, match="x:"):
        model.velocity(x[:1], t, cache)
    with pytest.raises(ValueError, match="t:"):
        model.velocity(x, t[:, None], cache)
    with pytest.raises(ValueError, match="rope_deltas"):
        model.velocity(x, t, random_cache(2, 8, seed=0, offsets=[8, 8], deltas=[[0], [0]]))
    short = prefix_cache(cache.keys[:1], cache.values[:1], [8, 8], [0, 0])
    with pytest.raises(ValueError, match="cache layers"):
        model.velocity(x, t, short)


# --- paged state (the fast path): same numbers as velocity(x, t, cache) -------------------


def test_paged_state_for_one_full_sample_spans_a_partial_last_block():
    # 1 sample that stopped last: T = 30 prefix columns (one full block of PAGE = 16 and a
    # partial one), then the 64 action tokens right after them in the same blocks.
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    cache = random_cache(1, 30, seed=1, offsets=[30], deltas=[-5])
    with torch.no_grad():
        state = model.prepare(cache)
        assert tuple(state.k_blocks[0].shape) == (-(-(30 + W) // PAGE), PAGE, KV_HEADS, HEAD_DIM)
        assert state.lengths.tolist() == [30 + W] and state.slots.tolist() == list(range(30, 30 + W))
        for seed in (2, 3):  # the state is reused: each call rewrites only the action slots
            x, t = noisy_action(1, seed)
            expected = model.velocity(x, t, cache)
            assert (model.velocity_prepared(x, t, state) - expected).abs().max() < 1e-5


def test_paged_state_matches_reference_with_offsets_and_invalid_columns():
    # Blocked columns (a stop gap, invalid columns even inside the prefix) are not copied:
    # each row keeps only what its action tokens attend, so nothing is masked.
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, :5] = False
    cache = random_cache(3, 40, seed=1, offsets=[40, 31, 22], deltas=[0, 3, -7], valid=valid)
    snapshot = [k.clone() for k in cache.keys] + [v.clone() for v in cache.values]
    with torch.no_grad():
        state = model.prepare(cache)
        assert state.lengths.tolist() == [40 + W, 26 + W, 22 + W]
        for seed in (2, 3):
            x, t = noisy_action(3, seed)
            expected = model.velocity(x, t, cache)
            assert (model.velocity_prepared(x, t, state) - expected).abs().max() < 1e-5
        # Not vacuous: the same blocks read past the kept columns give other numbers.
        state.lengths[1:] = state.lengths[0]
        unmasked = model.velocity_prepared(x, t, state)
    assert (unmasked - expected).abs().max() > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.keys + cache.values))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("padding", [1, 37, 256 - 30 - W])
def test_bucket_padding_does_not_change_the_velocity(rows, padding):
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    offsets = [30, 21, 26][:rows]
    cache = random_cache(rows, 30, seed=rows, offsets=offsets, deltas=[2] * rows)
    x, t = noisy_action(rows, seed=4)
    with torch.no_grad():
        state = model.prepare(cache, capacity=30 + W + padding)
        assert state.capacity == 30 + W + padding
        got = model.velocity_prepared(x, t, state)
        expected = model.velocity(x, t, cache)
    assert (got - expected).abs().max() < 1e-5


def test_reloaded_state_keeps_its_tensors_and_ignores_what_a_longer_plan_left_behind():
    # What a captured CUDA graph replays: the same tensors (addresses), refilled for a plan
    # of another prefix length, must give what a fresh eager state gives.
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    long_cache = random_cache(2, 60, seed=1, offsets=[60, 55], deltas=[0, 0])
    short_cache = random_cache(2, 20, seed=2, offsets=[20, 17], deltas=[4, 1])
    x, t = noisy_action(2, seed=3)
    with torch.no_grad():
        state = model.new_state(2, 128)
        model.load_state(state, [long_cache])
        model.velocity_prepared(x, t, state)
        addresses = [tensor.data_ptr() for tensor in (*state.k_blocks, state.lengths, state.slots, state.cos)]
        model.load_state(state, [short_cache])  # columns 20..59 of row 0 still hold the long plan
        flat = state.k_blocks[1][: state.own_blocks].flatten(0, 1)
        assert torch.equal(flat[20 + W : 60], long_cache.keys[1][0, :, 20 + W :].transpose(0, 1))
        got = model.velocity_prepared(x, t, state)
        fresh = model.velocity_prepared(x, t, model.prepare(short_cache))
        expected = model.velocity(x, t, short_cache)
    assert addresses == [tensor.data_ptr() for tensor in (*state.k_blocks, state.lengths, state.slots, state.cos)]
    assert (got - expected).abs().max() < 1e-5
    assert torch.equal(got, fresh)


def test_stacked_caches_in_one_state_equal_separate_calls():
    # The guided sampler runs conditional and route-free rows (different lengths) as one batch.
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    cond = random_cache(1, 40, seed=1, offsets=[40], deltas=[-3])
    free = random_cache(1, 31, seed=2, offsets=[31], deltas=[-1])
    x, t = noisy_action(1, seed=3)
    with torch.no_grad():
        state = model.new_state(2, 40 + W)
        model.load_state(state, [cond, free])
        both = model.velocity_prepared(torch.cat([x, x]), torch.cat([t, t]), state)
        expected = torch.cat([model.velocity(x, t, cond), model.velocity(x, t, free)])
    assert (both - expected).abs().max() < 1e-5


def test_bf16_paged_state_stays_close_to_bf16_reference():
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval().bfloat16()
    cache = random_cache(2, 24, seed=1, offsets=[24, 19], deltas=[0, 0])
    x, t = noisy_action(2, seed=2)
    with torch.no_grad():
        state = model.prepare(cache, capacity=128)
        got = model.velocity_prepared(x, t, state)
        expected = model.velocity(x, t, cache)
    assert state.k_blocks[0].dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    assert (got.float() - expected.float()).abs().max() < 0.02 * expected.float().abs().max()


def test_bad_states_are_named():
    model = ActionExpertModel(tiny_config())
    cache = random_cache(2, 30, seed=0, offsets=[30, 25], deltas=[0, 0])
    with pytest.raises(ValueError, match="capacity"):
        model.new_state(2, W)
    with pytest.raises(ValueError, match="rows"):
        model.new_state(0, 128)
    with pytest.raises(ValueError, match="capacity 90"):
        model.prepare(cache, capacity=90)
    with pytest.raises(ValueError, match="caches: 2 rows"):
        model.load_state(model.new_state(3, 128), [cache])
    state = model.prepare(cache)
    x, t = noisy_action(1, seed=1)
    with pytest.raises(ValueError, match="x:"):
        model.velocity_prepared(x, t, state)


# --- fused q/k/v: one GEMM on the fast path, upstream's parameters as views of its weight ---


class LinearWeights(TorchFunctionMode):
    """Records the weight of every F.linear call (observes, replaces nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.weights.append(args[1])
        return func(*args, **(kwargs or {}))


TIED = (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up", ("gate_proj", "up_proj")))


def assert_views_of_fused(layer) -> None:
    """Each tied group's weights (and biases) lie back to back in its fused tensors' memory:
    q/k/v_proj's in self_attn.qkv_*, gate/up_proj's in mlp.gate_up_*."""
    for module_name, fused_name, names in TIED:
        module = getattr(layer, module_name)
        for kind in ("weight", "bias"):
            fused = getattr(module, f"{fused_name}_{kind}")
            parts = [getattr(getattr(module, name), kind) for name in names]
            if parts[0] is None:
                assert fused is None
                continue
            address = fused.data_ptr()
            for part in parts:
                assert part.data_ptr() == address and part.is_contiguous()
                address += part.numel() * part.element_size()
            assert address == fused.data_ptr() + fused.numel() * fused.element_size()


def test_fused_weights_are_the_loaded_checkpoint(tiny_checkpoint: Path):
    config = AlpamayoConfig.from_checkpoint(tiny_checkpoint)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    model = load_expert(config, dtype=torch.float32, device="cpu")
    for i, layer in enumerate(model.expert.layers):
        for module_name, fused_name, names in TIED:
            loaded = [tensors[f"expert.layers.{i}.{module_name}.{name}.weight"] for name in names]
            assert torch.equal(getattr(getattr(layer, module_name), f"{fused_name}_weight"), torch.cat(loaded))
        assert_views_of_fused(layer)
    assert not any("qkv" in name or "gate_up" in name for name in model.state_dict())


@pytest.mark.parametrize("change", ["cast", "deepcopy", "load", "load_assign"])
def test_tied_projections_stay_views_that_reach_the_fast_path(change):
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config(attention_bias=True)).eval()
    weights = {name: tensor + 0.01 for name, tensor in model.state_dict().items()}
    first = model.expert.layers[0]
    fused_at = first.self_attn.qkv_weight.data_ptr(), first.mlp.gate_up_weight.data_ptr()
    if change == "cast":
        model = model.double().float()
    elif change == "deepcopy":
        model = copy.deepcopy(model)
    else:
        model.load_state_dict(weights, assign=change == "load_assign")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
        if change == "load":  # copied in place: a captured CUDA graph stays valid
            first = model.expert.layers[0]
            assert (first.self_attn.qkv_weight.data_ptr(), first.mlp.gate_up_weight.data_ptr()) == fused_at
    cache = random_cache(2, 30, seed=1, offsets=[30, 24], deltas=[0, 2])
    x, t = noisy_action(2, seed=2)
    with torch.no_grad():
        for layer in model.expert.layers:
            assert_views_of_fused(layer)
            layer.self_attn.k_proj.weight.mul_(-1.0)  # in-place edits must reach the fused
            layer.self_attn.v_proj.bias.add_(0.5)  # tensors the fast path reads
            layer.mlp.up_proj.weight.mul_(-1.0)
        fast = model.velocity_prepared(x, t, model.prepare(cache))
        assert (fast - model.velocity(x, t, cache)).abs().max() < 1e-5


def test_both_paths_project_each_tied_group_with_one_gemm_over_the_fused_weight():
    torch.manual_seed(0)
    model = ActionExpertModel(tiny_config()).eval()
    cache = random_cache(1, 20, seed=1, offsets=[20], deltas=[0])
    x, t = noisy_action(1, seed=2)
    with torch.no_grad():
        state = model.prepare(cache)
        for run in (lambda: model.velocity_prepared(x, t, state), lambda: model.velocity(x, t, cache)):
            with LinearWeights() as seen:
                run()
            for layer in model.expert.layers:
                for module_name, fused_name, names in TIED:
                    module = getattr(layer, module_name)
                    fused = getattr(module, f"{fused_name}_weight")
                    assert sum(w is fused for w in seen.weights) == 1
                    assert not any(w is getattr(module, name).weight for w in seen.weights for name in names)
