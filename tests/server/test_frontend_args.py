"""The server's own flags: the ``FrontendArgs`` dataclass, generated and checked like EngineConfig's."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import ConfigError
from jaxserve_server.cli import build_parser
from jaxserve_server.frontend_args import FrontendArgs


def serve_args(*argv: str) -> FrontendArgs:
    return FrontendArgs.from_cli_args(build_parser().parse_args(["serve", "jaxserve-demo", *argv]))


def test_defaults_and_flags_give_the_dataclass():
    assert serve_args() == FrontendArgs()
    args = serve_args("--port", "0", "--max-waiting", "7", "--enable-debug-endpoints", "--uvicorn-log-level", "debug")
    assert (args.port, args.max_waiting, args.enable_debug_endpoints, args.uvicorn_log_level) == (0, 7, True, "debug")


def test_every_field_is_a_flag_with_help_stating_its_default():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in serve._actions}
    for field in dataclasses.fields(FrontendArgs):
        assert field.name in helps and "default" in helps[field.name].lower(), field.name


@pytest.mark.parametrize("flag, value, message", [
    ("--max-waiting", "0", "--max-waiting must be at least 1"),
    ("--request-header-timeout", "0", "--request-header-timeout must be positive"),
    ("--max-chat-messages", "-1", "--max-chat-messages must be at least 1"),
])
def test_bad_values_are_config_errors(flag, value, message):
    with pytest.raises(ConfigError, match=message):
        serve_args(flag, value)


def test_generate_serves_the_model_it_is_given(tmp_path, capsys):
    # The engine flags reach LLM flat (EngineConfig.as_kwargs): a missing folder is refused, not
    # silently replaced by the default model.
    from jaxserve_server.cli import main

    assert main(["generate", str(tmp_path / "no-such-model"), "--max-tokens", "1"]) == 2
    assert "no-such-model" in capsys.readouterr().err
