"""The loader's counters as the run's TensorBoard metrics: token shares by source-column tag, and each mixture
source's share of the tokens, overall and in the current mixture stage (data/stages.py)."""

from __future__ import annotations

OTHER_SOURCES = "other"


def token_shares(counters: dict[str, int], top: int = 16) -> dict[str, float]:
    """data/token_share/<tag>: the share of the tokens counted by source-column tag so far, for the `top`
    tags with the most tokens (ties by tag name), the rest summed into data/token_share/other (a tag named
    'other' counts there too); the shares sum to 1. `top = 0`: none (`[data] token_share_sources`)."""
    if top < 0:
        raise ValueError(f"token_shares: top = {top} must be >= 0 (0: no per-source token shares)")
    tokens = {k.removeprefix("tokens/"): v for k, v in counters.items() if k.startswith("tokens/")}
    total = sum(tokens.values())
    if not total or not top:
        return {}
    ranked = sorted((tag for tag in tokens if tag != OTHER_SOURCES), key=lambda tag: (-tokens[tag], tag))
    out = {f"data/token_share/{tag}": tokens[tag] / total for tag in ranked[:top]}
    rest = [tokens[tag] for tag in ranked[top:]] + ([tokens[OTHER_SOURCES]] if OTHER_SOURCES in tokens else [])
    if rest:
        out[f"data/token_share/{OTHER_SOURCES}"] = sum(rest) / total
    return out


def mixture_counter(counters: dict[str, int], kind: str) -> dict[str, int]:
    """{source name: its `mixture/<name>/<kind>` counter} (kind: tokens or epochs), the one parse of those keys."""
    parts = (k.split("/") for k in counters)
    return {p[1]: counters["/".join(p)] for p in parts if len(p) == 3 and p[0] == "mixture" and p[2] == kind}


def source_shares(counters: dict[str, int]) -> dict[str, float]:
    """{source name: its share of the tokens delivered so far}, with a mixture of two or more sources."""
    tokens = mixture_counter(counters, "tokens")
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()} if len(tokens) > 1 and total else {}


def mixture_shares(counters: dict[str, int]) -> dict[str, float]:
    """data/mixture/<name>/share: each source's share of the tokens delivered so far (with a mixture)."""
    return {f"data/mixture/{name}/share": share for name, share in source_shares(counters).items()}


def stage_shares(counters: dict[str, int]) -> dict[str, float]:
    """data/stage_share/<name>: each source's share of the tokens delivered in the current mixture stage (with
    stages: the loader counts `mixture/<name>/stage_tokens`)."""
    tokens = mixture_counter(counters, "stage_tokens")
    total = sum(tokens.values())
    return {f"data/stage_share/{name}": n / total for name, n in tokens.items()} if total else {}
