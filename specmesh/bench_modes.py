"""The modes of `specmesh bench` (``--modes``), their labels, and the torch threads of the
in-process HF rows.

Through the gateway (one row per concurrency level):

* ``target``: target-only decoding through the same gateway (``speculation.disable``): what the
  serving path costs without speculation; the speedup base when ``hf-plain`` did not run;
* ``model``: the model drafter with a fixed k (``num_draft_tokens=k``);
* ``default``: the model drafter with ``num_draft_tokens=0``, i.e. whatever the gateway's default
  policy is (its configured k, else its adaptive choice per round). It replaces the former
  ``adaptive`` key, which sent exactly the same request;
* ``ngram``: the prompt-lookup drafter with a fixed k.

In the bench process, at concurrency 1 (specmesh.bench_hf):

* ``hf-plain``: the target's own ``generate(do_sample=False)``, no assistant: the speedup base;
* ``hf-static``: the same with a static KV cache (``cache_implementation="static"``), the
  first thing transformers' guide to faster inference suggests. Not among the default modes:
  on these CPUs it runs as fast as ``hf-plain``. On an H200 one prompt's third run was 3.2x
  as fast, and in a bench row its mean per request was 2.85x ``hf-plain``'s while a few
  requests took seconds (docs/performance.md), so a GPU run should include it and read both
  of its figures;
* ``hf``: transformers' assisted generation with the draft as assistant and a fixed k;
* ``hf-default``: assisted generation with the assistant's generation_config as saved, i.e.
  transformers' defaults unless the draft's config sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

MODE_KEYS = ("target", "model", "default", "ngram", "hf-plain", "hf-static", "hf",
             "hf-default")
DEFAULT_MODE_KEYS = tuple(key for key in MODE_KEYS if key != "hf-static")  # --modes default
HF_KEYS = ("hf-plain", "hf-static", "hf", "hf-default")  # in the bench process, concurrency 1
TARGET_KEY = "target"
PLAIN_KEY = "hf-plain"
ASSISTED_KEYS = ("hf", "hf-default")
SPEC_KEYS = ("model", "default")  # the SpecMesh rows the targets are about


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    disable: bool = False  # speculation.disable: target-only
    drafter: str = ""  # speculation.drafter
    k: int = 0  # draft tokens per round; 0 = the gateway's default (hf-default: HF's own)
    assistant: bool = False  # an HF row with the draft as assistant
    static_cache: bool = False  # an HF row with cache_implementation="static"

    @property
    def in_process(self) -> bool:
        """An HF row, run in the bench process rather than through the gateway."""
        return self.key in HF_KEYS


def make_modes(keys: list[str], k: int) -> list[Mode]:
    """The modes named by ``keys``, in MODE_KEYS order."""
    table = {"target": Mode("target", "SpecMesh target-only (serving-path overhead)",
                            disable=True),
             "model": Mode("model", f"SpecMesh model k={k}", drafter="model", k=k),
             "default": Mode("default", "SpecMesh (gateway defaults)", drafter="model"),
             "ngram": Mode("ngram", f"SpecMesh ngram k={k}", drafter="ngram", k=k),
             "hf-plain": Mode("hf-plain", "HF generate (plain, no assistant)"),
             "hf-static": Mode("hf-static", "HF generate (plain, static cache)",
                               static_cache=True),
             "hf": Mode("hf", f"HF assisted k={k}", k=k, assistant=True),
             "hf-default": Mode("hf-default", "HF assisted (HF defaults)", assistant=True)}
    return [table[key] for key in MODE_KEYS if key in keys]


def hf_threads(threads: int, cpus: int | None) -> int:
    """torch threads of the in-process HF rows: the mesh's model processes' together (the
    verifier's and the model drafter's, ``threads`` each), at most ``cpus``; 0 (torch's
    default) when the mesh's processes use torch's default too."""
    if threads <= 0:
        return 0
    return max(1, min(2 * threads, cpus or 1))


def hf_threads_note(threads: int, used: int, cpus: int | None, remote: bool) -> str:
    """The report's note on the HF rows' threads."""
    if used == 0:
        return ("In-process HF rows use torch's default threads, like the mesh's processes "
                "(--threads 0).")
    capped = f", capped at os.cpu_count() = {cpus}" if used < 2 * threads else ""
    remote_note = " (with --addr the remote mesh's threads are not known)" if remote else ""
    return (f"In-process HF rows use {used} torch threads: --threads {threads} × 2, the "
            f"verifier's and the model drafter's processes together{capped}{remote_note}.")
