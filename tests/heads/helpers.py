"""What the EAGLE drafter tests share (test_eagle.py, test_eagle_layer.py)."""

import torch

from headway.heads import EagleHead


def make_head(target, version, **kw):
    torch.manual_seed(version)
    if version == 3 and "draft_vocab_size" not in kw:
        kw.update(draft_vocab_size=120, draft_tokens=torch.arange(5, 125))
    head = EagleHead.from_target(target, version=version, **kw).double()
    with torch.no_grad():  # random, not copied, output projections so every piece matters
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return head.bind_target(target)
