"""The drafters ``headway bench`` runs: the folders its flags name are checked before the target loads."""

from types import SimpleNamespace

import pytest

from headway.bench.drafters import DRAFTER_KINDS, ONE_PASS_KINDS, check_drafter, drafter_folders
from headway.heads.dflash import DFlashHead
from headway.heads.medusa import MedusaHeads
from headway.heads.target.tiny import build_tiny_target


def test_a_drafter_of_another_kind_is_named_with_its_flag(tmp_path):
    target, _ = build_tiny_target("llama")
    DFlashHead.from_target(target, block_size=4).save_pretrained(tmp_path / "df")
    check_drafter(str(tmp_path / "df"), "dflash", "--dflash")
    with pytest.raises(ValueError, match=r"--eagle .* holds a 'dflash' drafter, not an EAGLE drafter; pass it with "
                                         r"--dflash"):
        check_drafter(str(tmp_path / "df"), "eagle", "--eagle")
    assert set(ONE_PASS_KINDS) <= set(DRAFTER_KINDS)


def test_the_folders_of_the_families_asked_for(tmp_path):
    target, _ = build_tiny_target("llama")
    MedusaHeads.from_target(target, num_heads=2).save_pretrained(tmp_path / "m")
    DFlashHead.from_target(target, block_size=4).save_pretrained(tmp_path / "df")
    args = SimpleNamespace(heads=str(tmp_path / "m"), eagle=[], peagle=[], layerskip=[], dflash=[str(tmp_path / "df")],
                           families=("medusa", "dflash"))
    assert drafter_folders(args) == (str(tmp_path / "m"), [])
    args.families = ("dflash",)  # Medusa not asked for: its folder is not used
    assert drafter_folders(args) == (None, [])
    args.dflash = [str(tmp_path / "m")]
    with pytest.raises(ValueError, match="holds a 'medusa' drafter, not a DFlash drafter; pass it with --heads"):
        drafter_folders(args)
