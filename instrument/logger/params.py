"""Hyperparameters as backends want them: flat, scalar-valued and free of secrets."""

import re
from typing import Any, Dict, Mapping

__all__ = ["flatten_params", "redact_secrets", "redact_config_text", "REDACTED"]

REDACTED = "<redacted>"
# Matched against the parts of a parameter's last name component: "reward_key" names a dict key, not a
# credential, so "key" counts only alone or in the usual credential compounds.
_SECRET_PARTS = {"token", "password", "passwd", "secret", "credential", "credentials"}
_SECRET_NAMES = {"key", "apikey", "api_key", "access_key", "secret_key", "private_key"}
_SCALAR = (str, int, float, bool, type(None))


def flatten_params(params: Mapping[str, Any], prefix: str = "", sep: str = "/") -> Dict[str, Any]:
    """Flatten nested mappings into ``a/b/c`` keys; non-scalar leaves become their ``repr``."""
    flat: Dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, name, sep))
        elif isinstance(value, _SCALAR):
            flat[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _SCALAR) for v in value):
            flat[name] = str(list(value))
        else:
            flat[name] = repr(value)
    return flat


def redact_secrets(params: Mapping[str, Any]) -> Dict[str, Any]:
    """Replace the value of every key that looks like a secret (token, key, password, secret)."""
    return {k: (REDACTED if _is_secret(k) else v) for k, v in params.items()}


# A gin binding line: optional scope, ``Name.param = value``.
_BINDING = re.compile(r"^(\s*)([\w./]+)(\s*=\s*)(.+)$")


def redact_config_text(text: str) -> str:
    """Redact the value of every secret-looking binding in a gin config text (``X.api_key = '...'``).

    The operative config is logged verbatim to every backend, so a token bound in a .gin file would otherwise
    reach W&B or MLflow in clear.
    """
    lines = []
    for line in text.splitlines():
        match = _BINDING.match(line)
        if match and _is_secret(match.group(2)):
            line = f"{match.group(1)}{match.group(2)}{match.group(3)}'{REDACTED}'"
        lines.append(line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _is_secret(name: str) -> bool:
    leaf = re.split(r"[/.]", name)[-1].lower().replace("-", "_")
    if leaf in _SECRET_NAMES or any(part in _SECRET_PARTS for part in leaf.split("_")):
        return True
    # "wandb_api_key", "aws_secret_access_key": a credential compound at the end of a longer name.
    return any(leaf.endswith("_" + n) for n in _SECRET_NAMES if "_" in n or n == "apikey")
