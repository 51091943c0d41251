"""Reading handle settings from a DeepSpeed ``"aio"`` section or a tuner result."""
import json

from .units import parse_size

# Names DeepSpeed and its tuner have used for the same setting.
_ALIASES = {
    "block_size": "block_size",
    "queue_depth": "queue_depth",
    "single_submit": "single_submit",
    "overlap_events": "overlap_events",
    "intra_op_parallelism": "intra_op_parallelism",
    "thread_count": "intra_op_parallelism",
    "num_threads": "intra_op_parallelism",
    "io_parallel": "intra_op_parallelism",
    "staging_bytes": "staging_bytes",       # nvmeswap's own (Note [staging ring])
    "memory_budget": "memory_budget",
    "engine": "engine",                     # nvmeswap's own (Note [engines])
}
# What DeepSpeed's get_aio_config takes for a setting its "aio" section leaves out: the
# settings its swappers run with, so the ones a handle from the same config must have.
_DEEPSPEED_DEFAULTS = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                       "single_submit": False, "overlap_events": True}
# Keys of a DeepSpeed "aio" section that say nothing about a handle.
_IGNORED = {"use_gds"}
# Keys that make a dict a whole DeepSpeed config: without an "aio" section, the defaults.
_DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "amp", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "sparse_gradients", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comms_logger", "monitor_config", "checkpoint", "data_types", "elasticity",
    "autotuning", "pipeline", "curriculum_learning", "data_efficiency",
    "compression_training", "sparse_attention", "progressive_layer_drop", "eigenvalue",
    "quantize_training", "hybrid_engine", "nebula", "compile", "weight_quantization",
    "timers", "seq_parallel_communication_data_type", "disable_allgather"}


def handle_arguments(config):
    """Keyword arguments for ``aio_handle`` from a dict or JSON text.

    Accepts ``{"aio": {...}}`` (a whole DeepSpeed config, whose missing ``"aio"``
    section means the defaults) or the section itself, DeepSpeed's legacy names
    (``num_threads``, ``thread_count``), ``"true"``/``"false"`` strings and sizes
    such as ``"1M"``. A setting left out takes DeepSpeed's default (queue depth 8,
    overlapped events), as DeepSpeed's swappers would run with the same config.
    """
    if isinstance(config, (str, bytes)):
        config = json.loads(config)
    if not isinstance(config, dict):
        raise TypeError(f"expected a dict or JSON text, got {type(config).__name__}")
    if "aio" in config:
        section = config["aio"]
        if not isinstance(section, dict):
            raise TypeError(f'the "aio" section must be a dict of settings, got '
                            f"{type(section).__name__}")
    elif _DEEPSPEED_KEYS.intersection(config) and not set(_ALIASES).intersection(config):
        section = {}
    else:
        section = config
    arguments, given_as = {}, {}
    for key, value in section.items():
        if key in _IGNORED:
            continue
        if key not in _ALIASES:
            raise ValueError(f"unknown aio setting {key!r}; known: {sorted(_ALIASES)}")
        name = _ALIASES[key]
        if name in ("single_submit", "overlap_events"):
            value = _boolean(key, value)
        elif name != "engine":              # the engine is checked by the handle
            value = _integer(key, value)
        if name in arguments and arguments[name] != value:
            raise ValueError(f"{given_as[name]} and {key} are one setting, given "
                             f"{arguments[name]!r} and {value!r}")
        arguments[name], given_as[name] = value, key
    return {**_DEEPSPEED_DEFAULTS, **arguments}


def _boolean(key, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value in (0, 1):
        return bool(value)
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _integer(key, value):
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise ValueError(f"{key} must be a whole number, got {value!r}")
