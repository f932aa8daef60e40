"""Values of the kernels' HILO_* build options (HILO_HLA="states16=1,out_warps=4", ...), parsed strictly: a value
that is neither a recognised flag nor an integer is an error naming the variable, the option and what it takes,
not a silent "off"."""

import os

FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_flag(var: str, key: str, val: str) -> bool:
    """On / off from 1, true, yes, on / 0, false, no, off (any case)."""
    word = val.strip().lower()
    if word not in FLAG_WORDS:
        raise ValueError(f"{var}: {key}={val.strip()!r}: expected 1 / true / yes / on or 0 / false / no / off")
    return FLAG_WORDS[word]


def parse_int(var: str, key: str, val: str) -> int:
    """An integer (optionally signed)."""
    try:
        return int(val.strip())
    except ValueError:
        raise ValueError(f"{var}: {key}={val.strip()!r}: expected an integer") from None


def read_options(var: str, options: dict, allowed: dict | None = None) -> None:
    """Set options' entries from the environment variable `var` ("key=1,other=32"): on / off for boolean entries,
    integers for integer ones (one of allowed[key] when given); an unknown key or a bad value is an error naming
    both."""
    for item in filter(None, (x.strip() for x in os.environ.get(var, "").split(","))):
        key, _, val = (part.strip() for part in item.partition("="))
        if key not in options:
            raise ValueError(f"{var}: unknown option {key!r}; expected one of {sorted(options)}")
        if isinstance(options[key], bool):
            options[key] = parse_flag(var, key, val)
            continue
        number = parse_int(var, key, val)
        if allowed and key in allowed and number not in allowed[key]:
            raise ValueError(f"{var}: {key}={val!r}: expected one of {list(allowed[key])}")
        options[key] = number
