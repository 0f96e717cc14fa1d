"""Tensor mode by the role of each linear layer, for any family built of the usual parts.

A decoder layer is recognised by its parts, not by its family: an attention module (q_proj,
k_proj, v_proj or a fused qkv_proj, then o_proj; head counts in n_heads / n_kv_heads) and an MLP
(gate/up/down, a fused gate_up_proj, or a mixture of experts: a router ``gate`` and a SwitchGLU
``switch_mlp``, maybe shared experts). Column-parallel layers (q, k, v, gate, up, the experts'
gate and up) keep the rows of this rank's heads or columns: no communication. Row-parallel
layers (o, down) keep the matching input features and sum their partial products over the
ranks (``all_sum``), adding a bias once. A mixture of experts sums once, after the block.
Norms, rotary embeddings, softcapping and sliding windows act per head or on the whole hidden
state and are left as they are; embeddings and the head stay whole.

Which heads and columns: cluster/core/tensorplan.py. A rank holds the KV heads its query heads
use, replicated when the ranks outnumber them. ``ModelError`` names a part this module does not
know, so the user hears why instead of getting wrong text.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from cluster.core.modelcheck import ModelError
from cluster.core.tensorplan import TensorPlan, spans

ATTENTION = ("self_attn", "attention", "attn")
LINEAR = ("linear_attn",)  # a gated delta net (Qwen3-Next's linear attention)
LINEAR_PARTS = {"in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"}
MLP = ("mlp", "block_sparse_moe", "feed_forward")
MIXER = "mixer"  # nemotron_h's one part per block: a Mamba-2 mixer, an attention, an MLP or MoE
MAMBA_PARTS = {"in_proj", "conv1d", "norm", "out_proj"}
MAMBA_COUNTS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size",
                "conv_dim")  # fmt: skip
KDA_PARTS = {"q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv", "f_a_proj", "f_b_proj",
             "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj"}  # fmt: skip
MLA_PARTS = {"q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "embed_q", "unembed_out", "o_proj"}
SWITCH_MLP = {"fc1", "fc2"}  # an ungated switch MLP's up and down (nemotron_h's experts)
HEADS = ("n_heads", "num_heads", "num_attention_heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
GROUPS = ("repeats", "n_rep", "num_key_value_groups")  # query heads per KV head, where kept
COLUMN = ("gate_proj", "up_proj")
ROW = ("down_proj",)
SHARED = ("shared_expert", "shared_experts")
SWITCH = ("switch_mlp", "switch_glu")  # the experts' stacked gate/up/down (SwitchGLU)
EXPERTS = ("experts",)  # a mixture of experts beside the dense MLP (gemma4), routed by the layer
WHOLE = ("router", "per_layer_input_gate", "per_layer_projection")  # act on the whole hidden
# state, which every rank holds: computed on each rank as they are (gemma4's router and its
# per-layer inputs)
NORMS = ("q_norm", "k_norm")  # per head: one weight for all heads, or one row per head


class RowParallel(nn.Module):
    """A linear layer that holds a span of its input features: the partial products of all
    ranks summed, the bias added once."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        if "bias" in inner:
            self.bias = inner["bias"]
            del inner["bias"]
        self.inner = inner
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x), group=self.group)
        return y + self["bias"] if "bias" in self else y


class RankSum(nn.Module):
    """A block (a mixture of experts) whose every expert holds a span of its columns: its
    output summed over the ranks."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def __call__(self, *args, **kwargs) -> mx.array:
        return mx.distributed.all_sum(self.inner(*args, **kwargs), group=self.group)


def keep_rows(module: nn.Module, rows: list[int]) -> None:
    """Keep these output features (rows) of a linear layer, float or quantized, or of every
    expert of a switch layer."""
    index = mx.array(rows, dtype=mx.uint32)
    for name in ("weight", "scales", "biases", "bias"):
        if name in module and module[name] is not None:
            axis = -1 if name == "bias" else -2
            module[name] = mx.contiguous(mx.take(module[name], index, axis=axis))


def keep_inputs(module: nn.Module, start: int, end: int) -> None:
    """Keep input features [start, end) of a linear or switch layer (quantized: on group
    boundaries, which the plan guarantees)."""
    full = input_dims(module)
    for name in ("weight", "scales", "biases"):
        if name not in module or module[name] is None:
            continue
        array = module[name]
        per = full // array.shape[-1]  # features per stored column (packing, groups)
        if start % per or end % per:
            raise ModelError(
                f"input features [{start}, {end}) of a {type(module).__name__} do not fall on "
                f"its {per}-feature boundaries (quantization groups); use --mode pipeline"
            )
        module[name] = mx.contiguous(array[..., start // per : end // per])


def input_dims(module: nn.Module) -> int:
    if "scales" in module:
        return module["scales"].shape[-1] * module.group_size
    return module["weight"].shape[-1]


def output_dims(module: nn.Module) -> int:
    return module["weight"].shape[-2]


def head_dim(attn: nn.Module) -> int:
    n_heads = getattr(attn, attr_of(attn, HEADS))
    if "qkv_proj" in children(attn):
        n_kv = getattr(attn, attr_of(attn, KV_HEADS))
        return output_dims(attn.qkv_proj) // (n_heads + 2 * n_kv)
    return output_dims(attn.q_proj) // n_heads


def first_attr(module: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(module, n, None), int)), None)


def attr_of(module: nn.Module, names: tuple[str, ...]) -> str:
    """The first of ``names`` the module has as an int (layer_problem checked it is there)."""
    name = first_attr(module, names)
    if name is None:
        raise ModelError(f"{type(module).__name__} has none of {', '.join(names)}")
    return name


def children(module: nn.Module) -> dict[str, nn.Module]:
    """The child modules that hold weights (a RoPE or an activation module holds none)."""
    return {
        k: v
        for k, v in module.children().items()
        if isinstance(v, nn.Module) and tree_flatten(v.parameters())
    }


def shard_attention(attn: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """Keep this rank's query heads and the KV heads they use. Head counts and sizes are the
    module's own (mimo's sliding layers differ from the config's; its values are narrower than
    its keys); a per-head parameter of the attention itself (attention sinks) keeps its heads."""
    heads_name, kv_name = attr_of(attn, HEADS), attr_of(attn, KV_HEADS)
    fused = "qkv_proj" in children(attn)
    n_heads, n_kv = getattr(attn, heads_name), getattr(attn, kv_name)
    dim = head_dim(attn)  # a query head's rows (Qwen3-Next's hold a gate too: twice a key's)
    k_dim = output_dims(attn.k_proj) // n_kv if "k_proj" in attn else dim
    v_dim = output_dims(attn.v_proj) // n_kv if "v_proj" in attn else k_dim
    heads, kvs = plan.attention(n_heads, n_kv)
    (h0, h1), kv = heads[rank], kvs[rank]
    q = [r for h in range(h0, h1) for r in range(h * dim, (h + 1) * dim)]
    k = [r for h in kv for r in range(h * k_dim, (h + 1) * k_dim)]
    if fused:  # [q | k | v] rows in one layer
        base_k, base_v = n_heads * dim, (n_heads + n_kv) * dim
        keep_rows(attn.qkv_proj, q + [base_k + r for r in k] + [base_v + r for r in k])
    else:  # gemma4: no v_proj where keys are values, neither where a layer reuses another's
        keep_rows(attn.q_proj, q)
        if "k_proj" in attn:
            keep_rows(attn.k_proj, k)
        if "v_proj" in attn:
            keep_rows(attn.v_proj, [r for h in kv for r in range(h * v_dim, (h + 1) * v_dim)])
    for name, rows in (("q_norm", list(range(h0, h1))), ("k_norm", kv)):
        norm = getattr(attn, name, None)
        if norm is not None and "weight" in norm and norm["weight"].ndim == 2:  # one per head
            norm["weight"] = mx.contiguous(mx.take(norm["weight"], mx.array(rows), axis=0))
    for name, value in list(attn.items()):
        if isinstance(value, mx.array) and value.shape == (n_heads,) and n_heads > 1:
            attn[name] = mx.contiguous(value[h0:h1])
    keep_inputs(attn.o_proj, h0 * v_dim, h1 * v_dim)
    attn.o_proj = RowParallel(attn.o_proj, group)
    setattr(attn, heads_name, h1 - h0)
    setattr(attn, kv_name, len(kv))
    for name in GROUPS:
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, (h1 - h0) // len(kv))


def shard_dense(mlp: nn.Module, span: tuple[int, int]) -> nn.Module:
    """Keep columns ``span`` of a gate/up/down (or gate_up/down) MLP; returns the down layer
    (the caller decides where the sum happens)."""
    i0, i1 = span
    if "gate_up_proj" in children(mlp):
        inter = output_dims(mlp.gate_up_proj) // 2
        keep_rows(mlp.gate_up_proj, [*range(i0, i1), *range(inter + i0, inter + i1)])
    else:
        for name in COLUMN:  # an ungated MLP (nemotron_h's) has only the up projection
            if name in children(mlp):
                keep_rows(getattr(mlp, name), list(range(i0, i1)))
    keep_inputs(mlp.down_proj, i0, i1)
    return mlp.down_proj


def shard_experts(block: nn.Module, plan: TensorPlan, rank: int) -> None:
    """A mixture of experts: every expert (and shared expert) keeps a span of its columns; the
    router stays whole. The caller sums the block's output."""
    parts = children(block)
    switch = next(parts[s] for s in SWITCH if s in parts)
    # as wide as the experts are (moe_intermediate_size, or mixtral's intermediate_size)
    columns = plan.columns(output_dims(switch.gate_proj))
    for layer in (switch.down_proj, *(getattr(parts.get(s), "down_proj", None) for s in SHARED)):
        if layer is not None and "bias" in layer:
            raise ModelError("tensor mode cannot split experts whose down projection has a bias")
    i0, i1 = columns[rank]
    for name in COLUMN:
        keep_rows(getattr(switch, name), list(range(i0, i1)))
    keep_inputs(switch.down_proj, i0, i1)
    for name in SHARED:
        if name in parts:  # as wide as the module is (configs name it in several ways)
            shared = parts[name]
            up = shared.gate_up_proj if "gate_up_proj" in children(shared) else shared.up_proj
            width = output_dims(up) // (2 if "gate_up_proj" in children(shared) else 1)
            shard_dense(shared, plan.columns(width)[rank])


def attention_problem(attn: nn.Module) -> str | None:
    parts = set(children(attn))
    fused = "qkv_proj" in parts
    # k and v may be missing (gemma4: keys used as values, or another layer's reused)
    wanted = {"o_proj", *(("qkv_proj",) if fused else ("q_proj",))}
    if "v_proj" in parts and "k_proj" not in parts:
        wanted.add("k_proj")
    parts_known = wanted | ({"k_proj", "v_proj"} & parts)
    heads_name, kv_name = first_attr(attn, HEADS), first_attr(attn, KV_HEADS)
    if heads_name is None or kv_name is None:
        return f"its attention ({type(attn).__name__}) keeps no head counts we know"
    if not wanted <= parts or parts - parts_known - set(NORMS):
        return (
            f"its attention ({type(attn).__name__}) has the parts {', '.join(sorted(parts))}, "
            "not q/k/v (or qkv) and o projections"
        )
    dims = {head_dim(attn)}
    if "k_proj" in parts:  # a query head may be wider than a key's (a gate beside it)
        dims.add(output_dims(attn.k_proj) // getattr(attn, kv_name))
    for name, heads in zip(NORMS, (heads_name, kv_name), strict=True):
        weight = getattr(attn, name, None)
        weight = weight.get("weight") if weight is not None else None
        shapes = {(d,) for d in dims} | {(getattr(attn, heads), d) for d in dims}
        if weight is not None and tuple(weight.shape) not in shapes:
            dim = max(dims)
            return (
                f"its {name} normalises across heads (weight {tuple(weight.shape)}, head_dim "
                f"{dim}): a rank does not hold every head"
            )
    return None


def mlp_problem(block: nn.Module) -> str | None:
    parts = set(children(block))
    dense = ({"gate_up_proj", "down_proj"}, {*COLUMN, *ROW})
    if parts in dense:
        return None
    switch = next((children(block)[s] for s in SWITCH if s in parts), None)
    if switch is not None and set(children(switch)) == {*COLUMN, *ROW}:
        if parts <= {"gate", *SWITCH, "shared_expert_gate", *SHARED} and all(
            set(children(children(block)[s])) in dense for s in SHARED if s in parts
        ):
            return None
    return f"its MLP ({type(block).__name__}) has the parts {', '.join(sorted(parts))}"


def linear_problem(la: nn.Module) -> str | None:
    parts = set(children(la))
    if parts != LINEAR_PARTS:
        return (f"its linear attention ({type(la).__name__}) has the parts "
                f"{', '.join(sorted(parts))}, not {', '.join(sorted(LINEAR_PARTS))}")  # fmt: skip
    counts = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    if not all(isinstance(getattr(la, n, None), int) for n in counts):
        return f"its linear attention ({type(la).__name__}) keeps no head counts we know"
    return None


def shard_linear_attention(la: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """A gated delta net (Qwen3-Next): each rank keeps a span of the key heads and the value
    heads that go with them, through every part that holds them (its fused input projections,
    grouped by key head; the depthwise convolution's q, k and v channels; the per-head decay
    and step; the output projection's inputs, summed over the ranks). Each rank's cache then
    holds its own heads' state."""
    nk, nv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    ratio = nv // nk
    k0, k1 = rank_span(nk, plan, rank, f"the linear attention's {nk} key heads")
    v0, v1 = k0 * ratio, k1 * ratio
    group_rows = 2 * dk + 2 * ratio * dv  # q, k, v, z of one key head, side by side
    keep_rows(
        la.in_proj_qkvz,
        [r for h in range(k0, k1) for r in range(h * group_rows, (h + 1) * group_rows)],
    )
    keep_rows(
        la.in_proj_ba, [r for h in range(k0, k1) for r in range(h * 2 * ratio, (h + 1) * 2 * ratio)]
    )
    key_dim = nk * dk
    channels = [*range(k0 * dk, k1 * dk), *range(key_dim + k0 * dk, key_dim + k1 * dk),
                *range(2 * key_dim + v0 * dv, 2 * key_dim + v1 * dv)]  # fmt: skip
    la.conv1d.weight = mx.contiguous(mx.take(la.conv1d.weight, mx.array(channels), axis=0))
    la.conv1d.groups = len(channels)
    for name in ("dt_bias", "A_log"):
        la[name] = mx.contiguous(la[name][v0:v1])
    keep_inputs(la.out_proj, v0 * dv, v1 * dv)
    la.out_proj = RowParallel(la.out_proj, group)
    la.num_k_heads, la.num_v_heads = k1 - k0, v1 - v0
    la.key_dim, la.value_dim = (k1 - k0) * dk, (v1 - v0) * dv
    la.conv_dim = len(channels)


def mamba_problem(mixer: nn.Module) -> str | None:
    parts = set(children(mixer))
    if parts != MAMBA_PARTS or not all(isinstance(getattr(mixer, n, None), int)
                                       for n in MAMBA_COUNTS):  # fmt: skip
        return f"its Mamba mixer ({type(mixer).__name__}) has the parts {', '.join(sorted(parts))}"
    return None


def shard_mamba(mixer: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """A Mamba-2 mixer (nemotron_h): each rank keeps a span of its groups and the heads that
    read them, through every part that holds them (the input projection's gate, x, B, C and
    step rows; the depthwise convolution's x, B and C channels; the per-head decay, skip and
    step bias; the gated norm, per group; the output projection's inputs, summed over the
    ranks). Each rank's cache then holds its own heads' convolution and SSM state."""
    n_groups, n_heads, p, n = mixer.n_groups, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
    g0, g1 = rank_span(n_groups, plan, rank, f"the Mamba mixer's {n_groups} groups")
    per = n_heads // n_groups
    h0, h1 = g0 * per, g1 * per
    inner, conv_dim = mixer.intermediate_size, mixer.conv_dim
    x = list(range(h0 * p, h1 * p))
    b = [inner + r for r in range(g0 * n, g1 * n)]
    c = [inner + n_groups * n + r for r in range(g0 * n, g1 * n)]
    channels = [*x, *b, *c]  # of the convolution's input: x, B, C
    keep_rows(mixer.in_proj, [*x, *(inner + r for r in channels),
                              *(inner + conv_dim + h for h in range(h0, h1))])  # fmt: skip
    index = mx.array(channels)
    mixer.conv1d.weight = mx.contiguous(mx.take(mixer.conv1d.weight, index, axis=0))
    if "bias" in mixer.conv1d:
        mixer.conv1d.bias = mx.contiguous(mx.take(mixer.conv1d.bias, index, axis=0))
    mixer.conv1d.groups = len(channels)
    for name in ("dt_bias", "A_log", "D"):
        mixer[name] = mx.contiguous(mixer[name][h0:h1])
    mixer.norm.weight = mx.contiguous(mixer.norm.weight[h0 * p : h1 * p])
    keep_inputs(mixer.out_proj, h0 * p, h1 * p)
    mixer.out_proj = RowParallel(mixer.out_proj, group)
    mixer.num_heads, mixer.n_groups = h1 - h0, g1 - g0
    mixer.intermediate_size, mixer.conv_dim = (h1 - h0) * p, len(channels)


def head_rows(h0: int, h1: int, dim: int) -> list[int]:
    return list(range(h0 * dim, h1 * dim))


def rank_span(total: int, plan: TensorPlan, rank: int, what: str) -> tuple[int, int]:
    """This rank's span of ``total`` heads or groups (as the plan weighs the ranks);
    ModelError naming ``what`` when the ranks outnumber them."""
    try:
        return spans(total, plan.weights or [1.0] * len(plan.heads))[rank]
    except ValueError:
        raise ModelError(
            f"tensor mode gives each rank a span of {what}: use at most {total} ranks, or "
            "--mode pipeline"
        ) from None


def shard_delta_attention(attn: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """Kimi's delta attention (Kimi-Linear): each rank keeps a span of its heads through every
    part that holds them (the q, k and v projections and their short convolutions; the
    decay's and gate's second low-rank projections, whose first stay whole; the step per
    head; the decay's bias), the output projection's inputs summed over the ranks. Each
    rank's cache then holds its own heads' convolution and delta state."""
    n, d = attn.num_heads, attn.head_dim
    h0, h1 = rank_span(n, plan, rank, f"the delta attention's {n} heads")
    rows = head_rows(h0, h1, d)
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj"):
        keep_rows(attn[name], rows)
    keep_rows(attn.b_proj, list(range(h0, h1)))
    index = mx.array(rows)
    for name in ("q_conv", "k_conv", "v_conv"):
        conv = attn[name].conv
        conv.weight = mx.contiguous(mx.take(conv.weight, index, axis=0))
        conv.groups = len(rows)
    attn.A_log = mx.contiguous(attn.A_log[:, :, h0:h1])
    attn.dt_bias = mx.contiguous(attn.dt_bias[h0 * d : h1 * d])
    keep_inputs(attn.o_proj, h0 * d, h1 * d)
    attn.o_proj = RowParallel(attn.o_proj, group)
    attn.num_heads, attn.projection_dim = h1 - h0, (h1 - h0) * d


def shard_latent_attention(attn: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """A latent attention (Kimi-Linear's MLA): each rank keeps a span of the query heads and
    their slices of the per-head up-projections; the latent (the cache) is every rank's."""
    n = attn.num_heads
    h0, h1 = rank_span(n, plan, rank, f"the latent attention's {n} heads")
    keep_rows(attn.q_proj, head_rows(h0, h1, attn.q_head_dim))
    for name in ("embed_q", "unembed_out"):
        for key in ("weight", "scales", "biases"):
            if key in attn[name]:
                attn[name][key] = mx.contiguous(attn[name][key][h0:h1])
    keep_inputs(attn.o_proj, h0 * attn.v_head_dim, h1 * attn.v_head_dim)
    attn.o_proj = RowParallel(attn.o_proj, group)
    attn.num_heads = h1 - h0


def kind_of_attention(attn: nn.Module) -> str | None:
    """ "delta" or "latent" for the attentions known by their parts (Kimi-Linear's), else None."""
    parts = set(children(attn))
    if parts == KDA_PARTS and all(isinstance(getattr(attn, n, None), int)
                                  for n in ("num_heads", "head_dim")):  # fmt: skip
        return "delta"
    if parts == MLA_PARTS and all(isinstance(getattr(attn, n, None), int)
                                  for n in ("num_heads", "q_head_dim", "v_head_dim")):  # fmt: skip
        return "latent"
    return None


def mixer_problem(mixer: nn.Module) -> str | None:
    """Why tensor mode cannot shard one nemotron_h block's mixer, or None."""
    parts = set(children(mixer))
    if "in_proj" in parts:
        return mamba_problem(mixer)
    if "o_proj" in parts:
        return attention_problem(mixer)
    if "switch_mlp" in parts:
        switch = children(mixer)["switch_mlp"]
        if set(children(switch)) != SWITCH_MLP or "bias" in switch.fc2:
            return f"its experts ({type(switch).__name__}) are not an fc1/fc2 switch MLP"
        if "fc2_latent_proj" in parts and "bias" in mixer.fc2_latent_proj:
            return "its experts' latent projection has a bias (it would be summed per rank)"
        shared = children(mixer).get("shared_experts")
        if shared is not None and set(children(shared)) != {"up_proj", "down_proj"}:
            return f"its shared experts have the parts {', '.join(sorted(children(shared)))}"
        return None
    if parts == {"up_proj", "down_proj"}:
        return None
    return f"its mixer ({type(mixer).__name__}) has the parts {', '.join(sorted(parts))}"


def shard_mixer(block: nn.Module, plan: TensorPlan, rank: int, group) -> None:
    """One nemotron_h block: its mixer split as what it is (mixer_problem said it can be)."""
    mixer = block.mixer
    parts = children(mixer)
    if "in_proj" in parts:
        shard_mamba(mixer, plan, rank, group)
    elif "o_proj" in parts:
        shard_attention(mixer, plan, rank, group)
    elif "switch_mlp" in parts:  # experts (in the latent space where there is one), shared
        switch = parts["switch_mlp"]
        i0, i1 = plan.columns(output_dims(switch.fc1))[rank]
        keep_rows(switch.fc1, list(range(i0, i1)))
        keep_inputs(switch.fc2, i0, i1)
        if "shared_experts" in parts:
            shared = parts["shared_experts"]
            shard_dense(shared, plan.columns(output_dims(shared.up_proj))[rank])
        block.mixer = RankSum(mixer, group)  # latent projection and sum: linear, no bias
    else:
        shard_dense(mixer, plan.columns(output_dims(mixer.up_proj))[rank])
        mixer.down_proj = RowParallel(mixer.down_proj, group)


def layer_problem(layer: nn.Module) -> str | None:
    """Why tensor mode cannot shard this decoder layer by its parts, or None when it can."""
    parts = children(layer)
    if set(parts) - {"norm"} == {MIXER}:  # nemotron_h: one mixer per block
        return mixer_problem(parts[MIXER])
    linear = next((a for a in LINEAR if a in parts), None)
    attn = linear or next((a for a in ATTENTION if a in parts), None)
    mlp = next((m for m in MLP if m in parts), None)
    if attn is None or mlp is None:
        return f"{type(layer).__name__} has no attention or MLP under a name we know"
    known = {attn, mlp, *WHOLE, *EXPERTS}
    others = sorted(set(parts) - known - {p for p in parts if "norm" in p})
    if others:
        return f"{type(layer).__name__} has parts we do not know: {', '.join(others)}"
    experts = [mlp_problem(parts[e]) for e in EXPERTS if e in parts]
    if not linear and kind_of_attention(parts[attn]) is not None:
        mixer = None
    else:
        mixer = linear_problem(parts[attn]) if linear else attention_problem(parts[attn])
    return mixer or mlp_problem(parts[mlp]) or next((p for p in experts if p), None)


def shard_tensor(layers: list[nn.Module], plan: TensorPlan, group) -> None:
    """Shard every decoder layer for this rank, in place."""
    rank = group.rank()
    for layer in layers:
        parts = children(layer)
        if set(parts) - {"norm"} == {MIXER}:
            shard_mixer(layer, plan, rank, group)
            continue
        mlp = next(m for m in MLP if m in parts)
        linear = next((a for a in LINEAR if a in parts), None)
        attn = parts[linear or next(a for a in ATTENTION if a in parts)]
        kind = None if linear else kind_of_attention(attn)
        if linear is not None:
            shard_linear_attention(attn, plan, rank, group)
        elif kind == "delta":
            shard_delta_attention(attn, plan, rank, group)
        elif kind == "latent":
            shard_latent_attention(attn, plan, rank, group)
        else:
            shard_attention(attn, plan, rank, group)
        for name in (mlp, *(e for e in EXPERTS if e in parts)):
            block = parts[name]
            if any(s in children(block) for s in SWITCH):
                shard_experts(block, plan, rank)
                setattr(layer, name, RankSum(block, group))
                continue
            width = output_dims(block.gate_up_proj if "gate_up_proj" in block else block.up_proj)
            width //= 2 if "gate_up_proj" in block else 1
            columns = plan.mlp if plan.mlp and plan.mlp[-1][1] == width else plan.columns(width)
            shard_dense(block, columns[rank])  # gemma4's KV-sharing layers: twice as wide
            block.down_proj = RowParallel(block.down_proj, group)
