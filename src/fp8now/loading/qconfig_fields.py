"""Every field of a pre-quantized checkpoint's `quantization_config` that formats.read_quantization_config reads,
checked for its JSON type first, so that a malformed config.json fails with the field's name instead of an
AttributeError or TypeError from deep inside the parser."""

from __future__ import annotations

# Per format: field -> the JSON types it may hold (None: may be null or absent).
FP8_FIELDS: dict[str, tuple] = {"activation_scheme": (str, None), "weight_block_size": (list, None),
                                "modules_to_not_convert": (list, None)}
CT_FIELDS: dict[str, tuple] = {"format": (str, None), "quantization_status": (str, None),
                               "config_groups": (dict, None), "ignore": (list, None)}
CT_GROUP_FIELDS: dict[str, tuple] = {"weights": (dict, None), "input_activations": (dict, None),
                                     "format": (str, None), "targets": (list, None)}
CT_ARGS_FIELDS: dict[str, tuple] = {"type": (str, None), "num_bits": (int, None), "strategy": (str, None),
                                    "block_structure": (list, None), "dynamic": (bool, str, None)}
# List fields -> the type of each element.
ELEMENTS: dict[str, type] = {"weight_block_size": int, "modules_to_not_convert": str, "ignore": str,
                             "targets": str, "block_structure": int}
_NAMES = {str: "a string", int: "a whole number", list: "a list", dict: "an object", bool: "true/false",
          None: "null"}


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _check(fields: dict, table: dict[str, tuple], where: str, path: str) -> None:
    for name, kinds in table.items():
        value = fields.get(name)
        ok = (value is None and None in kinds) or any(
            k is not None and isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
        if not ok:
            want = " or ".join(_NAMES[k] for k in kinds)
            raise ValueError(f"{where}: quantization_config.{path}{name} is {value!r} ({_kind(value)}); it must be "
                             f"{want}; config.json is corrupt or not an FP8 checkpoint's: re-export it")
        element = ELEMENTS.get(name)
        if isinstance(value, list) and element is not None:
            bad = [v for v in value if not isinstance(v, element) or (element is int and isinstance(v, bool))]
            if bad:
                raise ValueError(f"{where}: quantization_config.{path}{name} holds {bad[0]!r}; it must be a list "
                                 f"of {_NAMES[element].removeprefix('a ')}s; config.json is corrupt: re-export it")


def check_quantization_config(raw: dict, where: str) -> None:
    """Raise (naming `where` and the field) when a field the parser reads has the wrong JSON type."""
    method = raw.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"{where}: quantization_config.quant_method is {method!r}; it must name the format "
                         "('compressed-tensors' or 'fp8')")
    if method == "fp8":
        _check(raw, FP8_FIELDS, where, "")
    if method != "compressed-tensors":
        return
    _check(raw, CT_FIELDS, where, "")
    for name, group in (raw.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise ValueError(f"{where}: quantization_config.config_groups.{name} is {_kind(group)}; it must be an "
                             "object (targets, weights, input_activations); config.json is corrupt: re-export it")
        _check(group, CT_GROUP_FIELDS, where, f"config_groups.{name}.")
        for part in ("weights", "input_activations"):
            if isinstance(group.get(part), dict):
                _check(group[part], CT_ARGS_FIELDS, where, f"config_groups.{name}.{part}.")
