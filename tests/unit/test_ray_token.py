"""Where the token for a Ray cluster comes from, and the line that says what is missing."""

from __future__ import annotations

from pathlib import Path

from pdserve.deploy.ray_token import refusal, token_source


def test_the_token_is_looked_for_where_ray_looks(tmp_path: Path) -> None:
    assert token_source({}, tmp_path) is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert token_source({}, tmp_path) == ("~/.ray/auth_token", "from-home")
    named = tmp_path / "named"
    named.write_text("from-path")
    assert token_source({"RAY_AUTH_TOKEN_PATH": str(named)}, tmp_path) == (
        f"RAY_AUTH_TOKEN_PATH ({named})", "from-path")  # fmt: skip
    env = {"RAY_AUTH_TOKEN": " from-env ", "RAY_AUTH_TOKEN_PATH": str(named)}
    assert token_source(env, tmp_path) == ("RAY_AUTH_TOKEN", "from-env")
    assert token_source({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")}, tmp_path) == (
        "~/.ray/auth_token", "from-home")  # fmt: skip


def test_the_refusal_says_what_is_missing_and_how_to_pass_it() -> None:
    none = refusal("10.0.0.1:6379", {}, None)
    assert none.startswith("the Ray cluster at 10.0.0.1:6379 requires token authentication, and no token")
    assert all(
        how in none for how in ("RAY_AUTH_TOKEN=<token>", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE=token")
    )
    unsent = refusal("h:1", {"RAY_AUTH_TOKEN": "t"}, ("RAY_AUTH_TOKEN", "t"))
    assert "RAY_AUTH_MODE is not 'token'" in unsent and "set RAY_AUTH_MODE=token" in unsent
    wrong = refusal("h:1", {"RAY_AUTH_MODE": "token"}, ("~/.ray/auth_token", "t"))
    assert "refused the token from ~/.ray/auth_token" in wrong
