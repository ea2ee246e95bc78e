"""Which weights produced each generated token, as the engine itself labels them.

    label = weights_label(version, digest)          # "7:3fa9c1e0b2d44e81", after every commit
    llm.llm_engine.set_weight_version(label)        # vLLM stamps each sampled token with it
    versions, weights = token_provenance(completion.weight_versions, n_tokens, label)

After each publication commits, the rollout worker labels the engine's weights with the policy
version and the publication's digest (publish/manifest.py PublicationManifest.digest: the hash of
every bucket's layout and checksum).  vLLM records, per completion, the spans of output tokens
sampled under each label (CompletionOutput.weight_versions).  So a token's version is read back
from the engine, not assumed from when the call started, and a trajectory carries the digest of
the bytes behind each of its versions (trajectory.Trajectory.weights), which the policy checks
against what it published (train/policy.py quarantine: a mismatch is kept out of the loss).

A generate call runs between publications (rollout/worker.py), so all of its tokens must carry
the label served when it started; anything else is an error naming the tokens and both labels.
"""

from __future__ import annotations

UNSERVED = "none"  # the label of an engine that serves no version of this run (restarted, handed over)
FROM_DISK = "disk"  # the digest part for the checkpoint an engine loaded at start-up (no publication)


def weights_label(version: int | None, digest: str | None) -> str:
    if version is None:
        return UNSERVED
    return f"{int(version)}:{digest or FROM_DISK}"


def parse_label(label: str) -> tuple[int, str]:
    version, sep, digest = label.partition(":")
    if not sep or not version.isdigit():
        raise ValueError(f"weights label {label!r} is not '<version>:<digest>'")
    return int(version), digest


def token_provenance(spans, n_tokens: int, serving: str) -> tuple[list[int], dict[str, str]]:
    """(the version of each of `n_tokens` tokens, {version: digest}) from vLLM's spans
    [(label, start, end)]; every span must carry `serving` (no publication lands inside a call)."""
    if n_tokens == 0:
        return [], {}
    if not spans:
        raise RuntimeError(f"vLLM reported no weights label for {n_tokens} tokens (serving {serving!r})")
    versions: list[int] = []
    weights: dict[str, str] = {}
    for span in spans:
        label, start, end = span.version, span.start, span.end
        if label != serving or start != len(versions):
            raise RuntimeError(f"tokens {start}..{end} were sampled by weights labelled {label!r}, while this "
                               f"group served {serving!r} for the whole call")
        version, digest = parse_label(label)
        versions.extend([version] * (end - start))
        weights[str(version)] = digest
    if len(versions) != n_tokens:
        raise RuntimeError(f"vLLM's weights labels cover {len(versions)} of {n_tokens} tokens")
    return versions, weights
