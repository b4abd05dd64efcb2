"""Every hardware and model constant of the simulated engine, with its source.

Nothing else in the agent hard-codes a FLOP rate, a byte count or a bandwidth. The
arithmetic (docs/DESIGN.md "Why it exists")::

    KV bytes/token (MHA/GQA) = 2 (K,V) x layers x kv_heads x head_dim x bytes/elem
    KV bytes/token (MLA)     = layers x (kv_lora_rank + qk_rope_head_dim) x bytes/elem
    KV capacity (tokens)     = per-GPU (HBM x (1 - reserve) - weights/tp)
                               / (KV bytes/token / KV shards)
    KV transfer (P/D)        = prompt tokens x KV bytes/token / link bytes/s (LINKS)
    prefill(n new, c cached) = [2 x active_params x n  +  attn x n x (c + n/2)]
                               / (tp x peak x MFU)
    decode step(b, ctx)      = max((weights + KV(ctx)) / (tp x HBM bw),
                                   (2 x active_params x b + attn x ctx) / (tp x peak x MFU))
    scheduler step           = one forward pass over a prefill slice + the decode batch:
                               max(all its FLOPs / (tp x peak x MFU),
                                   (weights + every KV token it reads) / (tp x HBM bw))

``attn`` is the attention FLOPs per (query token, context token) pair:
``2 x heads x (qk_head_dim + v_head_dim)`` summed over layers. KV shards: GQA KV is
split over ``min(tp, kv_heads)`` GPUs; MLA's latent KV is replicated on every TP
rank (as SGLang does without DP attention), so its shard count is 1.

Check: 2,048 tokens of Llama-3-70B on one H100 at 60% MFU:
2 x 70.6e9 x 2048 / (989e12 x 0.6) = 0.487 s (docs/DESIGN.md rounds params to 70e9: 0.483 s).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixfleet.wire.errors import ConfigError

#: Model FLOPs utilisation assumed for prefill (compute-bound) work.
DEFAULT_MFU = 0.6
#: Share of each GPU's HBM kept for activations, CUDA graphs and the allocator.
#: Source: SGLang's ``mem_fraction_static`` defaults of 0.88-0.9 for 80 GB parts.
ACTIVATION_RESERVE_FRACTION = 0.10
#: Fixed cost of one scheduler step (kernel launches, sampling). 0: pure roofline.
DEFAULT_STEP_OVERHEAD_S = 0.0


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    #: dense BF16 tensor-core FLOP/s (no sparsity)
    peak_flops: float
    hbm_bytes: float
    #: HBM bandwidth, bytes/s
    hbm_bw: float
    source: str


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec(
            "a100-80g",
            312e12,
            80e9,
            2.039e12,
            "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, 80GB HBM2e, 2,039 GB/s",
        ),
        GpuSpec(
            "h100",
            989e12,
            80e9,
            3.35e12,
            "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense, 80GB HBM3, 3.35 TB/s",
        ),
        GpuSpec(
            "h200",
            989e12,
            141e9,
            4.8e12,
            "NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 141GB HBM3e, 4.8 TB/s",
        ),
        GpuSpec(
            "l4",
            121e12,
            24e9,
            300e9,
            "NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (242 sparse), 24GB GDDR6, 300 GB/s",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    #: all parameters (weight bytes) and those active per token (FLOPs; MoE < total)
    params_total: float
    params_active: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    #: bytes per weight and per KV element
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_elem: int = 2
    #: MLA: latent rank and decoupled RoPE dim (0: not MLA)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    #: attention head dims for FLOPs (0: head_dim)
    qk_head_dim: int = 0
    v_head_dim: int = 0
    max_context: int = 8192
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_bytes_per_token(self) -> int:
        if self.is_mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes_per_elem
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.weight_bytes_per_param

    @property
    def attn_flops_per_pair(self) -> float:
        """Attention FLOPs per (query, context token) pair over all layers."""
        qk = self.qk_head_dim or self.head_dim
        v = self.v_head_dim or self.head_dim
        return 2.0 * self.heads * (qk + v) * self.layers


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "llama-3-8b",
            8.03e9,
            8.03e9,
            32,
            32,
            8,
            128,
            max_context=8192,
            source="meta-llama/Meta-Llama-3-8B config.json; 8.03B params (model card)",
        ),
        ModelSpec(
            "llama-3-70b",
            70.6e9,
            70.6e9,
            80,
            64,
            8,
            128,
            max_context=8192,
            source="meta-llama/Meta-Llama-3-70B config.json; 70.6B params (model card)",
        ),
        ModelSpec(
            "qwen2.5-32b",
            32.8e9,
            32.8e9,
            64,
            40,
            8,
            128,
            max_context=32768,
            source="Qwen/Qwen2.5-32B config.json; 32.8B params (model card)",
        ),
        ModelSpec(
            "deepseek-v2-lite",
            15.7e9,
            2.4e9,
            27,
            16,
            16,
            128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_head_dim=192,
            v_head_dim=128,
            max_context=32768,
            source="deepseek-ai/DeepSeek-V2-Lite config.json (MLA, MoE 15.7B/2.4B active)",
        ),
        ModelSpec(
            "deepseek-v3",
            671e9,
            37e9,
            61,
            128,
            128,
            128,
            weight_bytes_per_param=1.0,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_head_dim=192,
            v_head_dim=128,
            max_context=131072,
            source="deepseek-ai/DeepSeek-V3 config.json (MLA, MoE 671B/37B active, FP8 weights)",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The link a disaggregated fleet moves a prompt's KV over, prefill -> decode."""

    name: str
    #: bytes/s in one direction (a transfer uses one)
    bytes_per_s: float
    source: str

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` at the link's full rate (no protocol overhead)."""
        return nbytes / self.bytes_per_s if nbytes > 0 else 0.0


LINKS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec(
            "nvlink",
            450e9,
            "NVIDIA H100 datasheet (SXM5): NVLink 4 900 GB/s bidirectional = 450 GB/s per direction",
        ),
        LinkSpec(
            "rdma",
            50e9,
            "NVIDIA ConnectX-7 datasheet: 400 Gb/s InfiniBand/Ethernet port = 50 GB/s per direction",
        ),
    )
}
#: the link a prefill worker's KV reaches a decode worker over when none is named
#: (the simulator's ``DisaggSpec`` and the agent's ``--kv-link``)
DEFAULT_LINK = "rdma"


#: Host <-> GPU link of the DRAM KV tier (``radixfleet_tools.agent.dram_tier``), one direction.
#: PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction theoretical
#: (PCI-SIG PCIe 5.0 specification; NVIDIA quotes 128 GB/s bidirectional for the H100
#: SXM5's host link). Achieved host<->device copies of pinned memory reach ~50 GB/s
#: (~80% of theoretical: TLP headers and flow control; CUDA ``bandwidthTest`` figures on
#: Gen5 hosts), so the tier prices copies at the achieved rate.
PCIE_GEN5_X16_THEORETICAL = LinkSpec(
    "pcie-gen5-x16-theoretical",
    64e9,
    "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b encoding, ~64 GB/s per direction",
)
PCIE_GEN5_X16 = LinkSpec(
    "pcie-gen5-x16",
    50e9,
    "PCIe Gen5 x16 achieved pinned host<->device copy rate (~50 GB/s of ~64 GB/s per direction; "
    "CUDA bandwidthTest on Gen5 hosts)",
)
#: the DRAM tier's capacity when enabled without a size: this many times the HBM pool
#: (a DGX H100 holds 2 TB of host DRAM for 640 GB of HBM: 3.2x; 4x of the KV pool alone
#: fits in it, since the weights take part of HBM)
DEFAULT_DRAM_RATIO = 4


def link_preset(name: str, path: str = "link") -> LinkSpec:
    """The ``LINKS`` preset ``name``; ``ConfigError`` at ``path`` naming the choices."""
    if name not in LINKS:
        raise ConfigError(path, f"unknown link preset {name!r}; choose one of {', '.join(LINKS)}")
    return LINKS[name]


def _preset(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ConfigError(kind, f"unknown {kind} preset {name!r}; choose one of {', '.join(table)}") from None


class CostModel:
    """Simulated GPU time for prefill and decode of one model on ``tp`` GPUs.

    Pure arithmetic, no clock: the scheduler asks how long a step takes.
    """

    __slots__ = (
        "model",
        "gpu",
        "tp",
        "mfu",
        "step_overhead_s",
        "_prefill_rate",
        "_weight_read_s",
        "_kv_read_s_per_token",
        "_decode_rate",
    )

    def __init__(
        self,
        model: ModelSpec | str,
        gpu: GpuSpec | str,
        *,
        tp: int = 1,
        mfu: float = DEFAULT_MFU,
        step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
    ) -> None:
        self.model = _preset(MODELS, "model", model) if isinstance(model, str) else model
        self.gpu = _preset(GPUS, "gpu", gpu) if isinstance(gpu, str) else gpu
        if type(tp) is not int or tp < 1:
            raise ConfigError("tp", f"tensor-parallel degree must be a positive integer, got {tp!r}")
        if not 0.0 < mfu <= 1.0:
            raise ConfigError("mfu", f"MFU must be in (0, 1], got {mfu!r}")
        self.tp = tp
        self.mfu = mfu
        self.step_overhead_s = step_overhead_s
        # effective FLOP/s of the TP group, and roofline terms of a decode step
        self._prefill_rate = tp * self.gpu.peak_flops * mfu
        self._decode_rate = tp * self.gpu.peak_flops * mfu
        bw = tp * self.gpu.hbm_bw
        self._weight_read_s = self.model.weight_bytes / bw
        self._kv_read_s_per_token = self.kv_bytes_per_token_per_gpu() * tp / bw

    # ------------------------------------------------------------- memory

    def kv_shards(self) -> int:
        return 1 if self.model.is_mla else min(self.tp, self.model.kv_heads)

    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.model.kv_bytes_per_token / self.kv_shards()

    def kv_transfer_bytes(self, tokens: int) -> float:
        """Bytes of ``tokens`` tokens' KV moved between two workers of this model: every
        layer's K and V (``kv_bytes_per_token``) once, whatever the TP shards (an MLA
        latent replicated over the ranks is sent once)."""
        return float(max(0, tokens) * self.model.kv_bytes_per_token)

    def kv_capacity_tokens(self, reserve_fraction: float = ACTIVATION_RESERVE_FRACTION) -> int:
        """KV tokens the pool holds. Raises ``ConfigError`` when the weights do not fit."""
        usable = self.gpu.hbm_bytes * (1.0 - reserve_fraction)
        free = usable - self.model.weight_bytes / self.tp
        if free <= 0:
            raise ConfigError(
                "tp",
                f"{self.model.name} weights ({self.model.weight_bytes / 1e9:.1f} GB) do not fit "
                f"{self.tp} x {self.gpu.name} ({usable * self.tp / 1e9:.1f} GB usable); "
                f"raise --tp or pass --kv-tokens",
            )
        return int(free // self.kv_bytes_per_token_per_gpu())

    def pcie_s(self, tokens: int, link: LinkSpec = PCIE_GEN5_X16) -> float:
        """Seconds to copy ``tokens`` tokens of KV between host DRAM and HBM over each
        GPU's own PCIe link: tokens x KV bytes/token per GPU (TP ranks copy their shards
        in parallel; with ``tp`` 1 the model's whole KV bytes/token) / link bytes/s."""
        return link.transfer_s(max(0, tokens) * self.kv_bytes_per_token_per_gpu())

    # ------------------------------------------------------------- time

    def prefill_linear_s(self, new_tokens: int) -> float:
        """The 2 x params x tokens part of prefill alone (the docs/DESIGN.md figure)."""
        return 2.0 * self.model.params_active * new_tokens / self._prefill_rate

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs of prefilling ``new_tokens`` after ``cached_tokens`` of context."""
        m = self.model
        return 2.0 * m.params_active * new_tokens + m.attn_flops_per_pair * new_tokens * (
            cached_tokens + new_tokens / 2.0
        )

    def decode_flops(self, batch: int, context_tokens: int) -> float:
        m = self.model
        return 2.0 * m.params_active * batch + m.attn_flops_per_pair * context_tokens

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill of ``new_tokens`` after ``cached_tokens`` of reused context (compute)."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill_flops(new_tokens, cached_tokens) / self._prefill_rate

    def forward_s(self, flops: float, kv_tokens_read: int) -> float:
        """One forward pass (a scheduler step) on the roofline: the slower of its
        compute and of reading the weights plus ``kv_tokens_read`` tokens of KV.
        A 1-token prefill is thus bounded below by the weight read, as on a GPU."""
        mem = self._weight_read_s + self._kv_read_s_per_token * kv_tokens_read
        return max(mem, flops / self._prefill_rate) + self.step_overhead_s

    def floor_ttft_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """The least time to first token of a ``prompt_tokens`` prompt whose first
        ``cached_tokens`` are cached, on an idle worker (no queue, no batch): its
        uncached part in one forward pass, ``forward_s`` of its FLOPs and of reading
        the weights and its whole KV. At least one prompt token is computed (its
        logits give the first token), as in the scheduler.

        A lower bound of the scheduler's own time for it at any ``chunk_tokens``
        and any smaller cached prefix: chunks sum to the same FLOPs (more with less
        cached), each reads the weights again, the last reads the whole KV. It is
        that time exactly when the uncached part fits one chunk. Not the time at a
        given chunk size: chunk boundaries can make a longer cached prefix cost one
        more small, weight-bound step, so a floor priced that way could exceed what
        a worker holding less achieves."""
        if prompt_tokens <= 0:
            return 0.0
        cached = max(0, min(cached_tokens, prompt_tokens - 1))
        return self.forward_s(self.prefill_flops(prompt_tokens - cached, cached), prompt_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step for ``batch`` sequences holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        mem = self._weight_read_s + self._kv_read_s_per_token * context_tokens
        return max(mem, self.decode_flops(batch, context_tokens) / self._decode_rate)

    def describe(self) -> dict:
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "tp": self.tp,
            "mfu": self.mfu,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "weight_bytes": self.model.weight_bytes,
            "peak_flops": self.gpu.peak_flops,
            "hbm_bytes": self.gpu.hbm_bytes,
            "hbm_bw": self.gpu.hbm_bw,
        }
