"""The CUDA engine's flags as the worker parses them (engine/cuda/args.py), for the CPU tests of each flag."""
import argparse

import pytest

from engine.cuda.args import CudaOptions, add_cuda_args


def cuda_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cuda_args(p)
    return p


def parse(*flags) -> argparse.Namespace:
    return cuda_parser().parse_args(list(flags))


def options(*flags) -> CudaOptions:
    return CudaOptions.from_args(parse(*flags))


def check_tune(key: str, value: str, typed, bad: str):
    """--tune KEY=value sets CudaOptions.KEY to `typed` (unset: the dataclass default), and KEY=bad is refused."""
    assert options() == CudaOptions()
    assert getattr(options("--tune", f"{key}={value}"), key) == typed
    with pytest.raises(SystemExit):
        parse("--tune", f"{key}={bad}")
