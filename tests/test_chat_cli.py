"""`hybrid chat` as a demanding terminal user meets it: a refused turn (the template's raise_exception, a
system role it does not take) is printed and dropped while the session goes on; Ctrl-C stops a reply and
keeps the history; slash commands are commands, never messages; model text on stdout, notes and stats on
stderr. The loop is driven with scripted input over a scripted engine and the demo tokenizer; the last
tests run the demo model itself (its tokenizer now covers its vocabulary, and turn 2 reuses all of turn 1)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal

import pytest

from hybrid.commands.chat import HELP, Chat
from hybrid.runtime.engine import Stats
from hybrid.runtime.generation import Completion
from hybrid.runtime.sampling import SamplingParams
from hybrid.runtime.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CENSOR = ("{% for m in messages %}{% if 'forbidden' in m.content %}{{ raise_exception('no forbidden topics') }}"
          "{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
REPLY = "Sure thing, here it is."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from hybrid.runtime.demo import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    with contextlib.redirect_stdout(io.StringIO()):  # (the corpus import prints the Zen of Python)
        build_tokenizer(d)
    return d


def tokenizer(tok_dir, chat_template=CHATML) -> Tokenizer:
    tok = Tokenizer(tok_dir)
    tok.chat_template, tok._compiled = chat_template, None
    return tok


class ScriptedEngine:
    """Engine.generate's contract with a fixed reply streamed token by token; `before_token(k)` runs before
    token k is streamed (to press Ctrl-C there)."""

    def __init__(self, tok, before_token=None):
        self.tokenizer, self.before_token = tok, before_token
        self.stats = Stats()
        self.prompts: list[list[int]] = []
        self.reply_ids = tok.encode(REPLY, add_special_tokens=False)

    def allocate_slot(self) -> int:
        return 0

    def generate(self, prompts, max_new_tokens, sampling, stop_strings, stream, conversation):
        ids = prompts[0]
        self.prompts.append(ids)
        self.stats.prefill_tokens += len(ids)
        for k, t in enumerate(self.reply_ids):
            if self.before_token is not None:
                self.before_token(k)
            stream(0, t, self.tokenizer.decode([t]))
        return [Completion(ids, list(self.reply_ids), self.tokenizer.decode(self.reply_ids), "length")]


def script(*lines):
    """input() over `lines`, then end of input; the prompts it was given are in .prompts."""
    it = iter(lines)

    def read(prompt=""):
        read.prompts.append(prompt)
        item = next(it, EOFError)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    read.prompts = []
    read.rest = it
    return read


def new_chat(tok, engine=None):
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(engine or ScriptedEngine(tok), tok, SamplingParams(), 32, 4096, out=out, err=err)
    return chat, out, err


def test_a_template_refusing_the_system_role_keeps_the_session(tok_dir):
    tok = tokenizer(tok_dir, NO_SYSTEM)
    chat, out, err = new_chat(tok)
    read = script("/system Be brief.", "hi", "/exit", "never read")
    assert chat.loop(read) == 0
    assert "refuses these messages: System role not supported" in err.getvalue()
    assert "the system prompt is unchanged" in err.getvalue()
    assert chat.system is None and len(chat.engine.prompts) == 1 and out.getvalue() == REPLY + "\n"
    assert next(read.rest) == "never read"  # /exit ended the loop


def test_a_refused_turn_is_dropped_and_the_next_one_runs(tok_dir):
    tok = tokenizer(tok_dir, CENSOR)
    chat, out, err = new_chat(tok)
    assert chat.loop(script("tell me forbidden things", "hello")) == 0
    assert "no forbidden topics" in err.getvalue() and "the message was dropped" in err.getvalue()
    (prompt,) = chat.engine.prompts
    assert "hello" in tok.decode(prompt) and "forbidden" not in tok.decode(prompt)
    assert chat.history == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": REPLY}]


@pytest.fixture
def terminal_sigint():
    """SIGINT handled by Python, as in a terminal: a suite started in the background inherits it ignored, and the
    chat rightly leaves an ignored SIGINT alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_the_reply_and_keeps_the_history(tok_dir, terminal_sigint):
    tok = tokenizer(tok_dir)
    pressed = []

    def press_ctrl_c(k):  # a real SIGINT, as the terminal sends it, during the first reply
        if k == 2 and not pressed:
            pressed.append(k)
            signal.raise_signal(signal.SIGINT)  # to this thread, where the chat's handler runs

    handler = signal.getsignal(signal.SIGINT)
    chat, out, err = new_chat(tok, ScriptedEngine(tok, press_ctrl_c))
    assert chat.loop(script("first", "second")) == 0
    assert "reply stopped" in err.getvalue()
    partial = chat.history[1]["content"]
    assert chat.history[0] == {"role": "user", "content": "first"}
    assert partial and REPLY.startswith(partial) and partial != REPLY
    assert chat.history[2:] == [{"role": "user", "content": "second"}, {"role": "assistant", "content": REPLY}]
    assert out.getvalue() == partial + "\n" + REPLY + "\n"
    assert signal.getsignal(signal.SIGINT) is handler  # restored after each reply


def test_ctrl_c_before_any_text_drops_the_message(tok_dir):
    tok = tokenizer(tok_dir)

    class Interrupted(ScriptedEngine):
        def generate(self, *args, **kwargs):
            if not self.prompts:
                self.prompts.append(None)
                raise KeyboardInterrupt  # a second Ctrl-C during the prefill
            return super().generate(*args, **kwargs)

    chat, out, err = new_chat(tok, Interrupted(tok))
    assert chat.loop(script("first", "second")) == 0
    assert "before any text" in err.getvalue()
    assert chat.history == [{"role": "user", "content": "second"}, {"role": "assistant", "content": REPLY}]


def test_ctrl_c_at_the_prompt(tok_dir):
    tok = tokenizer(tok_dir)
    chat, out, err = new_chat(tok)
    assert chat.loop(script(KeyboardInterrupt, "hi"), interactive=True) == 0  # the line is cleared
    assert "Ctrl-D or /exit quits" in err.getvalue() and REPLY in out.getvalue()
    chat, out, err = new_chat(tok)
    with pytest.raises(KeyboardInterrupt):  # piped input: Ctrl-C ends the program (exit 130 in main)
        chat.loop(script(KeyboardInterrupt, "hi"))


def test_slash_commands_are_not_sent_to_the_model(tok_dir):
    tok = tokenizer(tok_dir)
    chat, out, err = new_chat(tok)
    read = script("/help", "/bogus", "hi", "/clear", "there", "/reset", "//etc/hosts is a file", "/quit", "never")
    assert chat.loop(read) == 0
    assert out.getvalue() == HELP + "\n" + (REPLY + "\n") * 3
    assert "unknown command /bogus" in err.getvalue()
    texts = [tok.decode(p) for p in chat.engine.prompts]
    assert len(texts) == 3 and "help" not in "".join(texts) and "bogus" not in "".join(texts)
    assert "hi" in texts[0] and "hi" not in texts[1] and "there" not in texts[2]  # each /clear, /reset forgot
    assert "/etc/hosts is a file" in texts[2]  # // sends a leading slash
    assert next(read.rest) == "never"


def test_reply_on_stdout_prompt_on_stdout_when_interactive_stats_on_stderr(tok_dir):
    tok = tokenizer(tok_dir)
    chat, out, err = new_chat(tok)
    read = script("hi")
    assert chat.loop(read) == 0
    assert out.getvalue() == REPLY + "\n" and read.prompts == ["", ""]  # piped: no prompt at all
    assert re.search(r"^\[\d+ tokens; prefilled \d+ of \d+ prompt tokens", err.getvalue(), re.M)
    chat, out, err = new_chat(tok)
    read = script("hi")
    assert chat.loop(read, interactive=True) == 0
    # the prompt reaches stdout: through readline (input() writes it there) or written by the chat itself
    assert read.prompts[0] == "> " or out.getvalue().startswith("> ")
    assert "> " not in err.getvalue() and out.getvalue().endswith(REPLY + "\n\n")  # Ctrl-D: a newline


def test_turn_two_continues_from_the_reply_tokens(tok_dir):
    """The second prompt starts with exactly the ids the slot was fed: turn 1's prompt and the reply's own
    ids, even where re-encoding the reply's text would split it differently."""
    tok = tokenizer(tok_dir)
    engine = ScriptedEngine(tok)
    engine.reply_ids = [tok.token_id(c) for c in "Sure"]  # one token per letter: not how "Sure" encodes
    assert tok.encode("Sure", add_special_tokens=False) != engine.reply_ids
    chat, out, err = new_chat(tok, engine)
    assert chat.loop(script("hi", "more")) == 0
    first, second = engine.prompts
    assert second[: len(first) + 4] == first + engine.reply_ids
    assert tok.decode(second, skip_special_tokens=False) == tok.apply_chat_template(chat.messages(chat.history[:3]))


# --- the demo model through the CLI --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_dir():
    from hybrid.runtime.demo import demo_checkpoint

    return demo_checkpoint()


def checkpoint_with_template(demo_dir, dst, chat_template):
    """The demo's weights (hard links where they can be: the loader refuses symlinks leaving the folder)
    with another chat template."""
    import shutil

    dst.mkdir()
    for f in demo_dir.iterdir():
        if f.name != "tokenizer_config.json":
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy(f, dst / f.name)
    cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": chat_template}))
    return dst


def test_startup_template_refusals_are_one_line_exit_2(demo_dir, tmp_path, capsys, monkeypatch):
    from hybrid.cli import main

    monkeypatch.setattr("builtins.input", lambda _prompt="": pytest.fail("chat must not start"))
    d = checkpoint_with_template(demo_dir, tmp_path / "m", NO_SYSTEM)
    assert main(["chat", "--model", str(d), "--system", "Be brief."]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hybrid chat: error: chat template ") and "System role not supported" in err[-1]
    assert "Traceback" not in "".join(err)
    d = checkpoint_with_template(demo_dir, tmp_path / "g", "{{ raise_exception('never') }}")
    assert main(["generate", "--chat", "--model", str(d), "--prompt", "hi", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hybrid generate: error: chat template ") and err[-1].endswith("messages: never")


def test_demo_tokenizer_covers_the_model_and_turn_two_reuses_turn_one(demo_dir, capsys, monkeypatch):
    from hybrid.cli import main

    vocab = json.loads((demo_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(demo_dir)
    assert tok.vocab_size == vocab
    monkeypatch.setattr("builtins.input", script("Hello there, how are you?", "Tell me more."))
    assert main(["chat", "-n", "8"]) == 0
    err = capsys.readouterr().err
    assert "another model" not in err and "warning" not in err
    (n1, p1, t1), (n2, p2, _) = [(int(n), int(p), int(t)) for t, p, n in re.findall(
        r"\[(\d+) tokens; prefilled (\d+) of (\d+) prompt tokens", err)]
    assert p1 == n1 and n2 - p2 >= n1 + t1 - 1  # turn 2 prefills only the last reply token and the new message
