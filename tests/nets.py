"""Model definitions that diagnose tests name with ``--model tests/nets.py:Class``."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """Needs its width: the constructor argument a Lightning run saves."""

    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, classes)
        # not part of the state dict: load_state_dict never asks for it
        self.register_buffer("scratch", torch.zeros(width), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class Wrapped(nn.Module):
    """A Lightning-style module: Net's keys sit under 'model.'."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.model = Net(width)


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


class Huge(nn.Module):
    """About 40 GB of float32 weights if it were ever allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(100_000, 100_000)


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise ValueError("this model is broken on purpose")


class WithExtra(Net):
    """Net with extra state: strict loading wants an ``_extra_state`` key."""

    def __init__(self) -> None:
        super().__init__(8)

    def get_extra_state(self) -> dict[str, int]:
        return {"version": 2}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.version = state["version"]


class Exits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise SystemExit("bye")


def make_net(width: int = 8) -> nn.Module:
    """A factory function instead of a class."""
    return Net(width)


NOT_CALLABLE = 3


class DSTiny(nn.Module):
    """The model of the DeepSpeed fixtures (tests/fixtures/deepspeed/make_deepspeed.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.lin = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(24)
        self.frozen = nn.Linear(24, 5)
        self.out = nn.Linear(24, 3)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("buf", torch.arange(4.0))
        self.register_buffer("counts", torch.tensor([1, 2, 3], dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
