"""The CUDA engine's flags as the worker parses them (engine/cuda/args.py), for the CPU tests of each flag."""
import argparse

import pytest

from engine.cuda.args import add_cuda_args


def cuda_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cuda_args(p)
    return p


def parse(*flags) -> argparse.Namespace:
    return cuda_parser().parse_args(list(flags))


def check_choice(flag: str, dest: str, value: str, bad: str):
    """The flag defaults to None (the engine's default), takes `value`, and refuses `bad`."""
    p = cuda_parser()
    assert getattr(p.parse_args([]), dest) is None
    assert getattr(p.parse_args([flag, value]), dest) == (int(value) if value.isdigit() else value)
    with pytest.raises(SystemExit):
        p.parse_args([flag, bad])
