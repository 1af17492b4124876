"""Triton's model configuration, in its JSON form, built from a loaded model version.

Tools written for Triton (``tritonclient``'s ``get_model_config``, perf_analyzer,
model analyzers) read ``/v2/models/{m}/config`` to learn the batch limit, tensor
types and dims, and batching settings; this renders the manifest in that shape.
"""

from __future__ import annotations

from typing import Any

from edged.backends.specs import native_backend, platform_of
from edged.config import VersionPolicy
from edged.core.public import ModelVersion
from edged.repository.manifest import TensorSpec


def triton_data_type(datatype: str) -> str:
    """v2 datatype name -> Triton's config enum (BYTES is TYPE_STRING there)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def instance_kind(device: str | None) -> str:
    d = (device or "CPU").upper()
    if d.startswith("CPU"):
        return "KIND_CPU"
    if d.startswith(("GPU", "CUDA", "DLA")):
        return "KIND_GPU"
    return "KIND_MODEL"  # NPUs and the like: placement is the engine's business


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.specific is not None:
        return {"specific": {"versions": list(policy.specific)}}
    return {"latest": {"num_versions": policy.latest or 1}}


def _tensor(spec: TensorSpec, *, output: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": spec.name,
        "data_type": triton_data_type(spec.datatype),
        "dims": list(spec.shape),
        "is_shape_tensor": False,
    }
    if not output:
        entry.update({"format": "FORMAT_NONE", "allow_ragged_batch": False, "optional": False})
    else:
        entry["label_filename"] = ""
    return entry


# What the serving engine says of its threads (edged.threadplan, [limits] engine_*): a model's runs are
# only as fast as the pool it got, and a shared or per-model pool, its spin and worker processes are set
# per daemon and per engine, so an operator reads here what applies to this version.
_THREAD_FIELDS = ("pool", "intra_op_threads", "threads", "streams", "spin_us", "engine_processes")


def _engine_threads(mv: ModelVersion) -> dict[str, dict[str, str]]:
    engine = mv.engine
    if engine is None:
        return {}
    described = engine.describe()
    return {f"edged_engine_{k}": {"string_value": str(described[k])} for k in _THREAD_FIELDS if k in described}


def model_config(mv: ModelVersion, policy: VersionPolicy) -> dict[str, Any]:
    """The Triton ``ModelConfig`` message as JSON for one loaded (or failed) version."""
    manifest = mv.entry.manifest
    cand = mv.candidate
    if cand is not None:
        backend, device, variant_file = cand.backend, cand.device, cand.variant.file
    elif manifest is not None:
        first = manifest.variants[0]
        backend, device, variant_file = native_backend(first.format) or "", "CPU", first.file
    else:
        backend, device, variant_file = "", "CPU", ""
    mbs = mv.max_batch_size
    inputs = [_tensor(s, output=False) for s in mv.inputs]
    outputs = [_tensor(s, output=True) for s in mv.outputs]
    if manifest is not None and manifest.labels and len(outputs) == 1:
        outputs[0]["label_filename"] = manifest.labels
    instances = manifest.instances.count if manifest else 1
    kind = instance_kind(device)
    config: dict[str, Any] = {
        "name": mv.name,
        "platform": platform_of(backend) or "",
        "backend": backend,
        "version_policy": _version_policy(policy),
        "max_batch_size": mbs,
        "input": inputs,
        "output": outputs,
        "batch_input": [],
        "batch_output": [],
        "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                         "output_pinned_memory": {"enable": True}},
        "instance_group": [{
            "name": f"{mv.name}_0",
            "kind": kind,
            "count": instances,
            "gpus": [0] if kind == "KIND_GPU" else [],
            "secondary_devices": [],
            "profile": [],
            "passive": False,
            "host_policy": "",
        }],
        "default_model_filename": variant_file,
        "cc_model_filenames": {},
        "metric_tags": {},
        "parameters": {
            "edged_device": {"string_value": device},
            "edged_precision": {"string_value": cand.precision if cand else ""},
            "edged_state": {"string_value": mv.state.value},
            **_engine_threads(mv),
        },
        "model_warmup": [],
    }
    if mv.pipeline is not None:  # Triton's ensemble form: each model step with its tensor maps
        config["platform"] = "ensemble"
        config["ensemble_scheduling"] = {"step": [
            {"model_name": n.spec.model, "model_version": n.spec.version or -1,
             "input_map": dict(n.reads), "output_map": dict(n.writes)}
            for n in mv.pipeline.nodes if n.spec.model is not None]}
    if mv.batching is not None:
        b = mv.batching
        config["dynamic_batching"] = {
            "preferred_batch_size": list(b.preferred_batch_sizes),
            "max_queue_delay_microseconds": b.max_queue_delay_us,
            "preserve_ordering": False,
            "priority_levels": 0,
            "default_priority_level": 0,
            "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 0,
                                     "allow_timeout_override": True, "max_queue_size": b.max_queue_size},
            "priority_queue_policy": {},
        }
    return config
