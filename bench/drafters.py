"""Which trained drafters ``headway bench`` runs: the folders its flags name, checked before the target loads
(one-line errors for a missing folder or a drafter of another kind), and the quick demo's heads by default."""

from __future__ import annotations

from pathlib import Path

from headway.heads.base import read_config_file, resolve_folder

DEMO_HEADS = str(Path("outputs", "demo", "quick", "heads"))  # make demo's Medusa heads, relative to the current folder
DRAFTER_KINDS = {"medusa": "Medusa heads", "eagle": "an EAGLE drafter", "peagle": "a P-EAGLE drafter",
                 "dflash": "a DFlash drafter", "layerskip": "a LayerSkip exit head"}
# kinds benchmarked as their own chain and tree="auto", DFlash also with a dynamic tree (--peagle, --dflash,
# --layerskip: repeatable folders)
ONE_PASS_KINDS = ("peagle", "dflash", "layerskip")


def check_drafter(folder_or_id: str, kind: str, flag: str) -> None:
    """A drafter the user named must exist and be of the kind the flag takes; one-line errors."""
    found = read_config_file(resolve_folder(folder_or_id)).get("drafter_type")
    if found != kind:
        other = {"medusa": "--heads"}.get(found, f"--{found}" if found in DRAFTER_KINDS else None)
        raise ValueError(f"{flag} {folder_or_id} holds a {found!r} drafter, not {DRAFTER_KINDS[kind]}"
                         + (f"; pass it with {other}" if other else ""))


def drafter_folders(args) -> tuple[str | None, list[str]]:
    """(Medusa heads, EAGLE drafters) to benchmark, for the families --methods runs: those named are
    checked before the model loads; without --heads, the quick demo's heads when make demo wrote them."""
    heads, eagle = args.heads, args.eagle if "eagle" in args.families else []
    if "medusa" not in args.families:
        heads = None
    elif heads is None and Path(DEMO_HEADS, "config.json").is_file():
        heads = DEMO_HEADS
    elif heads is None:
        print(f"(no Medusa heads at {DEMO_HEADS}: run `make demo` first, or pass --heads)")
    else:
        check_drafter(heads, "medusa", "--heads")
    for folder in eagle:
        check_drafter(folder, "eagle", "--eagle")
    for kind in ONE_PASS_KINDS:
        for folder in getattr(args, kind) if kind in args.families else []:
            check_drafter(folder, kind, f"--{kind}")
    return heads, list(eagle)
