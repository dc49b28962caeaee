"""The line formats of engine/protocol.py: round trips and every refusal."""
import numpy as np
import pytest

from engine import protocol
from engine.protocol import Done, GenRequest, ProtocolError


def test_gen_round_trip_with_every_key():
    params = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 42, "penalty_repeat": 1.1,
              "penalty_freq": 0.2, "penalty_present": 0.3, "penalty_last_n": -1}
    req = GenRequest(max_new=17, prompt=[1, 2, 30000], params=params)
    line = protocol.format_gen(req)
    assert line.startswith("GEN 17 temperature=0.7 top_k=40 ") and line.endswith(" 1,2,30000")
    back = protocol.parse_gen(line)
    assert back.max_new == 17 and back.prompt == [1, 2, 30000] and back.params == params


def test_gen_leaves_defaults_out():
    line = protocol.format_gen(GenRequest(3, [5], {"temperature": 0.0, "top_p": 1.0, "seed": None}))
    assert line == "GEN 3 5"
    assert protocol.parse_gen(line).params == {}
    assert protocol.parse_gen(line).param("top_p") == 1.0


def test_gen_tolerates_extra_spaces():
    assert protocol.parse_gen("GEN  2  top_k=3   1,2\n").prompt == [1, 2]


@pytest.mark.parametrize("line,needle", [
    ("GEN", "GEN needs"),
    ("GEN 5", "GEN needs"),
    ("GEN x 1,2", "max_new 'x' is not an integer"),
    ("GEN -1 1,2", "max_new must be >= 0"),
    ("GEN 5 1,,2", "comma-separated token ids"),
    ("GEN 5 1,2,", "comma-separated token ids"),
    ("GEN 5 temperature=1 ", "comma-separated token ids"),
    ("GEN 5 temp=1 1,2", "unknown key 'temp'"),
    ("GEN 5 temperature 1,2", "expected key=value"),
    ("GEN 5 temperature=hot 1,2", "not a valid float"),
    ("GEN 5 temperature=nan 1,2", "finite"),
    ("GEN 5 top_k=2.5 1,2", "not a valid int"),
    ("GEN 5 temperature=-1 1,2", "temperature must be >= 0"),
    ("GEN 5 top_p=0 1,2", "top_p must be in (0, 1]"),
    ("GEN 5 min_p=1.5 1,2", "min_p"),
    ("GEN 5 penalty_repeat=0 1,2", "penalty_repeat"),
    ("GEN 5 penalty_last_n=-2 1,2", "penalty_last_n"),
    ("GEN 5 seed=-1 1,2", "seed must be >= 0"),
    ("STOP", "starting with GEN"),
])
def test_gen_refusals_name_the_problem(line, needle):
    with pytest.raises(ProtocolError) as e:
        protocol.parse_gen(line)
    assert needle in str(e.value)


def test_format_gen_refuses_an_empty_prompt():
    with pytest.raises(ProtocolError):
        protocol.format_gen(GenRequest(1, []))


def test_done_has_14_fields_and_round_trips():
    d = Done(generated=5, prompt=10, prompt_ms=12.34, decode_ms=56.78, finish="cancel", reused=3, hits=7,
             lookups=9, ram_blobs=2, file_blobs=1, file_mb=3.5, prompt_read=4)
    line = protocol.format_done(d)
    assert line == "DONE 5 10 12.3 56.8 cancel 0 0 3 7 9 2 1 3.5 4"
    assert len(line.split()) == 15
    back = protocol.parse_done(line)
    assert (back.generated, back.finish, back.reused, back.prompt_read, back.file_mb) == (5, "cancel", 3, 4, 3.5)


@pytest.mark.parametrize("line", ["DONE 1 2 3", "DONE 5 10 1.0 1.0 maybe 0 0 0 0 0 0 0 0.0 0",
                                  "DONE x 10 1.0 1.0 stop 0 0 0 0 0 0 0 0.0 0"])
def test_bad_done_lines_are_refused(line):
    with pytest.raises(ProtocolError):
        protocol.parse_done(line)


def test_info_pp_err_kind():
    line = protocol.format_info(engine="0.1.0", n_layer=4, pcie_gbps=55.5)
    assert line == "INFO engine=0.1.0 n_layer=4 pcie_gbps=55.5"
    assert protocol.parse_info(line) == {"engine": "0.1.0", "n_layer": "4", "pcie_gbps": "55.5"}
    with pytest.raises(ProtocolError):
        protocol.format_info(name="two words")
    assert protocol.parse_pp(protocol.format_pp(512, 1000, 250.0, 2048.0)) == (512, 1000, 250.0, 2048.0)
    assert protocol.format_err("bad\nthing  here") == "ERR bad thing here"
    assert [protocol.kind(x) for x in ("T 5", "READY 4096 stop", "DONE 1", "TOKEN 3", "")] == ["T", "READY", "DONE",
                                                                                               "", ""]


def test_cache_picture_round_trip():
    rng = np.random.default_rng(1)
    resident = rng.random((3, 10)) < 0.4
    heat = rng.integers(0, 256, (3, 10), dtype=np.uint8)
    line = protocol.format_cache(3, 10, resident.ravel(), heat.tobytes())
    n_layer, n_expert, r, h = protocol.parse_cache(line)
    assert (n_layer, n_expert) == (3, 10)
    assert (r == resident).all() and (h == heat).all()
