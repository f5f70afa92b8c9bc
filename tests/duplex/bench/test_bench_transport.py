"""`duplex bench --transport`: the same prompt through every transport, onsets per transport."""

from __future__ import annotations

import asyncio

from duplex.base.config import load_profile
from duplex.bench.cli import main
from duplex.bench.common import InProcessServer
from duplex.bench.transport import format_transport_table, run_transport_bench
from duplex.cli import build_parser
from duplex.runtime.service import DuplexService
from duplex.testing.fakes import fake_stages, scripted_answer, tone_speech


def test_every_transport_answers_and_adds_almost_nothing_over_native():
    service = DuplexService(load_profile("cpu"), fake_stages(scripted_answer))
    server = InProcessServer(service)
    url = server.start()
    try:
        prompt = "what is the capital of france"
        result = asyncio.run(
            run_transport_bench(
                url.split("/v1/")[0],
                ["native", "twilio", "audiosocket", "realtime"],
                [prompt],
                {prompt: tone_speech(prompt)},
                audiosocket=server.audiosocket,
                progress=None,
            )
        )
    finally:
        server.stop()
        service.close()
    rows = result["transports"]
    assert set(rows) == {"native", "twilio", "audiosocket", "realtime"}
    for name, row in rows.items():
        assert row["failed"] == 0 and row["onset_s"]["n"] == 1, (name, result["samples"][name])
        # the tone stages answer at once: onset is the 500 ms end-of-turn hangover plus transport
        assert 0.4 < row["onset_s"]["p50"] < 0.8, (name, row)
    for name in ("twilio", "audiosocket", "realtime"):
        assert abs(rows[name]["vs_native"]["paired_diff_s"]["p50"]) < 0.06, (name, rows[name])
    table = format_transport_table(result)
    assert "twilio" in table and "vs native" in table


def test_bench_transport_arguments_are_checked(capsys):
    args = build_parser().parse_args(["bench", "--transport", "carrier-pigeon"])
    assert main(args) == 2
    assert "--transport takes" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--transport", "twilio", "--tones"])
    assert main(args) == 2
    assert "--tones needs --serve" in capsys.readouterr().err
