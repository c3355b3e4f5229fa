"""EngineConfig: every serving knob the tuner searches is one validated field here.

Loaded once from YAML (or a dict) at the boundary; unknown keys are errors so a typo in a
config never silently falls back to a default. The engine reads these fields and nothing
else, which is what makes a tuned `best.yaml` reproducible in `tune bench` and `tune serve`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from slotune.kernels.tiles import DecodeAttentionConfig, MatmulConfig, PrefillAttentionConfig

SchedulingPolicy = Literal["fcfs", "shortest_prompt_first"]  # admission order (slotune/engine/scheduler.py)

DEFAULT_MODEL = "smollm2-135m"
# Served: a request waits behind at most this many others (a few batches on a GPU, about a
# minute of queue at CPU speed) before the server says 429 instead of queueing without end.
DEFAULT_MAX_PENDING_REQUESTS = 256


class StrictModel(BaseModel):
    """Base of every user-written config (engine, tuning spec, workload): unknown fields and
    non-finite numbers are refused with the field's name."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _EngineModel(StrictModel):
    model_config = ConfigDict(validate_assignment=True)  # cfg.field = value is validated too


class KernelConfig(_EngineModel):
    """Which operator implementation runs, and the tile sizes of our Triton kernels (their types, values
    and defaults are the kernels' own: slotune/kernels/tiles.py)."""

    backend: Literal["auto", "torch", "triton", "native"] = Field(
        "auto",
        description="auto: Triton on CUDA, the native CPU step where it runs, else torch; native: that step or error",
    )
    # Integer dot products as llama.cpp's Q4/Q8 x Q8; faster, most at larger batches. The error against
    # float32 logits is measured in docs/design/engine-quantization.md: a lever for the quality gates to judge.
    int8_activations: bool = Field(
        False,
        description="CPU native step, int4/int8 layers and LM head: quantize activations to int8",
    )
    # Coarser groups cut the int8 kernels' per-group scaling, the limit of the AMX tiles at 16+ rows;
    # their error is measured in docs/design/engine-quantization.md.
    int8_activation_group_size: Literal[32, 64, 128, 256] = Field(
        32, description="with int8_activations: inputs per activation scale (the last group of a row may be shorter)"
    )
    decode_attention: DecodeAttentionConfig = DecodeAttentionConfig()
    prefill_attention: PrefillAttentionConfig = PrefillAttentionConfig()
    matmul: MatmulConfig = MatmulConfig()


class SpeculativeConfig(_EngineModel):
    """Speculative decoding: a cheap draft proposes tokens, the target verifies them in one pass."""

    method: Literal["none", "ngram", "early_exit", "quantized", "model"] = "none"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    ngram_max: int = Field(3, ge=1, le=8, description="longest n-gram matched for prompt lookup")
    ngram_min: int = Field(1, ge=1, le=8)
    early_exit_layers: int = Field(8, ge=1, description="layers the early-exit self-draft runs")
    draft_quantization: Literal["int8", "int4"] = "int4"
    draft_model: str | None = Field(None, description="local path of a draft model (method=model)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method == "model" and not self.draft_model:
            raise ValueError("speculative.draft_model is required when speculative.method is 'model'")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative.ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self


class AdmissionConfig(_EngineModel):
    """Bounds that turn overload into fast, explicit rejections instead of unbounded queues.

    Without any of these set, a request is still bounded: prompt <= max_model_len - 1 tokens,
    prompt + max_tokens <= max_model_len, and it must fit the whole KV cache. A served engine
    (`tune serve`, served trials) also holds at most max_num_seqs + max_pending_requests
    requests by default; the offline `LLM` API queues its own batch and is not bounded by that.
    """

    max_prompt_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(
        None,
        ge=0,
        description="engine: requests waiting to be scheduled "
        "beyond which add_request refuses (queue_full); None = unbounded",
    )
    max_tokens_in_flight: int | None = Field(None, ge=1)
    # Held: being tokenized, waiting in the engine queue or being admitted; the 429 carries Retry-After.
    max_pending_requests: int | None = Field(
        DEFAULT_MAX_PENDING_REQUESTS,
        ge=0,
        description="served: requests the HTTP server holds beyond max_num_seqs, then 429 queue_full; None = unbounded",
    )


class EngineConfig(_EngineModel):
    """The full serving configuration of one engine instance."""

    model: str = Field(DEFAULT_MODEL, description="'smollm2-135m' (bundled GGUF), a .gguf file or an HF checkpoint dir")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="activation/compute dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1)
    # Fewer threads than cores leave cores to the HTTP server and its clients.
    num_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU: the engine's intra-op threads (torch.set_num_threads); None = torch's default, one per core",
    )

    # Weight quantization (weight-only unless fp8).
    quantization: Literal["none", "int8", "int4", "fp8"] = "none"
    quant_group_size: Literal[32, 64, 128, 256] = 64

    # KV cache.
    kv_dtype: Literal["auto", "int8", "fp8"] = "auto"
    block_size: Literal[8, 16, 32, 64] = 16
    num_kv_blocks: int | None = Field(None, ge=2, description="fixed block count; None = size from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(
        0.25, gt=0, description="memory budget for the KV cache when num_kv_blocks is None"
    )
    enable_prefix_caching: bool = False

    # Batching.
    scheduling: Literal["continuous", "static"] = "continuous"
    # shortest_prompt_first passes a request over at most 64 times (scheduler.MAX_BYPASS), so none waits forever.
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="admission order: fcfs, or shortest_prompt_first (lower TTFT on mixed prompt lengths)",
    )
    max_num_seqs: int = Field(16, ge=1, le=1024)
    max_num_batched_tokens: int = Field(2048, ge=16, le=2**24)
    max_model_len: int = Field(2048, ge=16, le=2**24)
    enable_chunked_prefill: bool = True

    speculative: SpeculativeConfig = SpeculativeConfig()
    admission: AdmissionConfig = AdmissionConfig()
    # vLLM's and SGLang's --stream-interval: fewer events, socket writes and client parses per token at high
    # concurrency, burstier arrival between them. First and last tokens go at once, so TTFT and E2E do not change.
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="served streams: tokens accumulated per SSE event; 1 = every step's tokens as they come",
    )
    kernels: KernelConfig = KernelConfig()
    use_cuda_graph: bool = Field(True, description="capture decode steps as CUDA graphs (CUDA only)")

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is false, or a long prompt never fits"
            )
        if self.speculative.method == "early_exit" and self.speculative.early_exit_layers < 1:
            raise ValueError("speculative.early_exit_layers must be >= 1")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        return cls.from_dict(load_yaml(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "EngineConfig":
        data = dict(data or {})
        if isinstance(data.get("engine"), str) and "knobs" in data:
            raise ValueError(
                f"this is a launch of the external server {data['engine']} (a best.yaml of a spec with "
                "`server:`), not a config of the bundled engine: start it with `tune serve` or the command on its "
                "`# launch:` line"
            )
        # best.yaml files written by the tuner nest the config under `engine:`.
        if set(data) == {"engine"} or ("engine" in data and "metrics" in data):
            data = data["engine"]
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def with_updates(self, updates: dict[str, Any]) -> "EngineConfig":
        """Copy with dotted-path overrides ("speculative.method": "ngram"), validated once."""
        data = self.model_dump(mode="json")
        for key, value in updates.items():
            node = data
            *parents, leaf = key.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    raise ValueError(f"unknown config field '{key}'")
                node = node[p]
            node[leaf] = value
        return EngineConfig.model_validate(data)

    def value_at(self, key: str) -> Any:
        """The value of a dotted-path field ("speculative.method"), as `with_updates` names them."""
        v: Any = self
        for part in key.split("."):
            v = getattr(v, part)
        return v


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    with path.open() as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
