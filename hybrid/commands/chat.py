"""`hybrid chat`: interactive chat with the model's chat template, streaming each reply.

Streams: the model's text goes to stdout, and so does the "> " prompt when stdin is a terminal (piped
input gets no prompt, so stdout holds the replies alone); notes, errors and the per-reply stats go to stderr.

A turn that fails is dropped and the session goes on: the template refusing the messages, a conversation
longer than --max-context, message text the tokenizer would turn into a control token. Ctrl-C during a
reply stops that reply (at the next token; a second Ctrl-C stops at once) and keeps the text shown so far in
the history; Ctrl-C at the prompt clears the line; Ctrl-D or /exit quits.

Each turn continues the KV slot of the one before (Conversation). The prompt is built from the ids that
slot was fed, not from the reply's text: the previous prompt and the reply's own token ids, then the ids of
what the template writes after the reply. Re-encoding the reply's text rarely gives back the ids the model
chose (another split of the same text, or bytes of a broken character decoded to U+FFFD), and every turn
would then prefill the last reply again. Where the template renders the history differently from what the
slot holds (a template that drops earlier reasoning, say), the whole conversation is encoded afresh.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from dataclasses import dataclass

from hybrid.errors import UsageError

HELP = """commands:
  /help            this list
  /reset, /clear   forget the conversation (the system prompt stays)
  /system [TEXT]   set the system prompt (without TEXT: remove it)
  /exit, /quit     leave (as Ctrl-D does)
  //TEXT           send "/TEXT" as a message
Ctrl-C stops a reply and keeps what it wrote; at the prompt it clears the line."""


def register(subparsers) -> None:
    from hybrid.loading.parse import add_model_arguments

    p = subparsers.add_parser("chat", help="interactive chat (chat template, streaming)",
                              description="Chat in the terminal. Commands: /help lists them; /reset clears the "
                              "history, /exit (or Ctrl-D) quits; Ctrl-C stops a reply. Replies go to stdout, "
                              "stats and notes to stderr. Without --model the built-in demo model (trained on "
                              "Shakespeare) is used.")
    p.add_argument("-n", "--max-new-tokens", type=int, default=256, help="reply length limit (default 256)")
    p.add_argument("--system", help="system prompt")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args, input_fn=None) -> int:
    from hybrid.loading.parse import sampling_from_args
    from hybrid.loading.session import open_session

    if args.max_new_tokens < 1:
        raise UsageError("-n must be at least 1")
    sampling = sampling_from_args(args)
    s = open_session(args)
    if s.tokenizer.chat_template is None:
        raise UsageError(f"{s.model_dir} has no chat template (tokenizer_config.json); use `hybrid generate`")
    chat = Chat(s.engine, s.tokenizer, sampling, args.max_new_tokens, args.max_context, args.stop)
    chat.set_system(args.system)  # a template that fails (or refuses the system prompt): one line, exit 2
    from hybrid.runtime.device_role import is_cuda

    where = "" if is_cuda(s.device) else " (CPU-only: no CUDA device, the model runs as torch on the CPU)"
    print(f"chat ready{where}: /help lists the commands, /exit quits", file=sys.stderr)
    interactive = sys.stdin.isatty()
    return chat.loop(input_fn or _builtin_input, interactive=interactive)


def _builtin_input(prompt: str) -> str:
    return input(prompt)  # looked up per call, so tests can replace builtins.input


@dataclass
class Fed:
    """What the conversation's KV slot holds: token ids and the rendered text they stand for, of which
    `markers` control ids are the template's own."""

    text: str
    ids: list[int]
    markers: int


class Chat:
    """One chat session: the history, its KV slot and the loop reading lines. `out` gets the model's text
    (and /help), `err` notes, errors and stats."""

    def __init__(self, engine, tokenizer, sampling, max_new_tokens: int, max_context: int, stop=(),
                 out=None, err=None):
        from hybrid.runtime.generation import Conversation

        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_new_tokens, self.max_context, self.stop = max_new_tokens, max_context, list(stop or ())
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.system: str | None = None
        self.history: list[dict] = []  # user and assistant messages, the system prompt apart
        self.fed: Fed | None = None
        self.conversation = Conversation.open(engine)  # each turn prefills only what is new

    # --- the loop ----------------------------------------------------------------------------------------
    def loop(self, input_fn, interactive: bool = False) -> int:
        """Reads lines until /exit or end of input; returns the exit status."""
        read = _line_reader(input_fn, self.out, interactive)
        while True:
            try:
                line = read()
            except EOFError:
                if interactive:
                    self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                if not interactive:
                    raise
                self.out.write("\n")
                self.note("(Ctrl-D or /exit quits)")
                continue
            if not self.handle(line):
                return 0

    def handle(self, line: str) -> bool:
        """One line of input: a command or a message. False to quit."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(*(text.split(maxsplit=1) + [""])[:2])
        self.turn(line[line.index("/") + 1:] if text.startswith("//") else line)
        return True

    def command(self, name: str, arg: str) -> bool:
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            print(HELP, file=self.out, flush=True)
        elif name in ("/reset", "/clear"):
            self.history, self.fed = [], None
            self.note("(conversation cleared)")
        elif name == "/system":
            from hybrid.runtime.tokenizer import ChatTemplateError

            try:
                self.set_system(arg.strip() or None)
                self.note("(system prompt set)" if self.system else "(no system prompt)")
            except ChatTemplateError as exc:
                self.note(f"error: {exc}; the system prompt is unchanged")
        else:
            self.note(f"unknown command {name}; /help lists the commands (//text sends \"/text\")")
        return True

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    # --- turns -------------------------------------------------------------------------------------------
    def messages(self, history: list[dict] | None = None) -> list[dict]:
        """The conversation as the template gets it: the system prompt, then `history` (default: the chat's)."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + list(
            self.history if history is None else history)

    def set_system(self, system: str | None) -> None:
        """Sets the system prompt (None: none) once the template has rendered it with the history and a
        user message; ChatTemplateError if it cannot (a template that takes no system prompt, say)."""
        probe = ([{"role": "system", "content": system}] if system else []) + self.history
        self.tokenizer.apply_chat_template(probe + [{"role": "user", "content": "Hello"}])
        self.system, self.fed = system, None

    def turn(self, text: str) -> None:
        """Sends one user message and streams the reply; on any refusal the turn is dropped."""
        history = self.history + [{"role": "user", "content": text}]
        try:
            ids, rendered = self.prompt(self.messages(history))
        except ValueError as exc:  # ChatTemplateError, or text the tokenizer would make a control token of
            self.note(f"error: {exc}; the message was dropped")
            return
        except KeyboardInterrupt:
            self.note("(interrupted; the message was dropped)")
            return
        if len(ids) >= self.max_context:
            self.note(f"the conversation has {len(ids)} tokens, more than --max-context {self.max_context}; "
                      "/reset to start over (the message was dropped)")
            return
        self.reply(history, ids, rendered)

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """(ids, rendered text) of the prompt for `messages`: the ids the slot holds plus the template's
        continuation where the history renders as the slot holds it, else the whole conversation encoded."""
        from hybrid.runtime.chat_tokens import control_token_ids

        tok = self.tokenizer
        ids, text = tok.encode_chat(messages), tok.apply_chat_template(messages)
        fed = self.fed
        if fed is None or not text.startswith(fed.text):
            return ids, text
        control = control_token_ids(tok)
        at = [i for i, t in enumerate(ids) if t in control]
        if len(at) <= fed.markers:
            return ids, text
        tail = ids[at[fed.markers]:]  # from the template's first marker after the reply
        if tok.decode(tail, skip_special_tokens=False) != text[len(fed.text):]:
            return ids, text
        return fed.ids + tail, text

    def reply(self, history: list[dict], ids: list[int], rendered: str) -> None:
        """Generates and streams the reply to prompt `ids`; the history then holds it (or the part shown
        before Ctrl-C)."""
        shown: list[str] = []
        stop = threading.Event()

        def stream(_i, _token, delta):
            if delta:
                self.out.write(delta)
                self.out.flush()
                shown.append(delta)
            if stop.is_set():
                raise KeyboardInterrupt  # between two tokens: the engine is in a consistent state

        st = self.engine.stats
        before = (st.prefill_tokens, st.decode_tokens, st.decode_s)
        try:
            with _first_interrupt_sets(stop):
                out = self.engine.generate([ids], max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                           stop_strings=self.stop, stream=stream,
                                           conversation=self.conversation)[0]
        except KeyboardInterrupt:
            self.out.write("\n")
            self.out.flush()
            self.fed = None
            if shown:
                self.history = history + [{"role": "assistant", "content": "".join(shown)}]
                self.note("(reply stopped; what it wrote stays in the history, /reset clears it)")
            else:
                self.note("(reply stopped before any text; the message was dropped)")
            return
        self.out.write("\n")
        self.out.flush()
        self.history = history + [{"role": "assistant", "content": out.text}]
        self.fed = self.fed_after(ids, rendered, out)
        prefilled = st.prefill_tokens - before[0]
        n, dt = st.decode_tokens - before[1], st.decode_s - before[2]
        self.note(f"[{len(out.token_ids)} tokens; prefilled {prefilled} of {len(ids)} prompt tokens "
                  f"({len(ids) - prefilled} reused from the last turn); prefill {st.prefill_tps:.1f} tok/s, "
                  f"decode {(n / dt if dt else 0):.1f} tok/s]")

    def fed_after(self, ids: list[int], rendered: str, out) -> Fed | None:
        """What the slot holds after a reply to prompt `ids` (text `rendered`), if the reply's ids stand
        exactly for its text (not so when a stop string cut the text, or the reply holds a control token,
        which its text leaves out)."""
        from hybrid.runtime.chat_tokens import control_token_ids

        tok = self.tokenizer
        if tok.decode(out.token_ids, skip_special_tokens=False) != out.text:
            return None
        control = control_token_ids(tok)
        return Fed(rendered + out.text, ids + out.token_ids, sum(t in control for t in ids))


def _line_reader(input_fn, out, interactive: bool):
    """Reads one line. Interactive, the prompt goes to stdout: through readline (line editing and history)
    where it loads, else written here (without readline Python would write it to stderr)."""
    if not interactive:
        return lambda: input_fn("")
    try:
        import readline  # noqa: F401 - input() edits lines with it and writes its prompt to stdout
    except ImportError:
        def read():
            out.write("> ")
            out.flush()
            return input_fn("")

        return read
    return lambda: input_fn("> ")


@contextlib.contextmanager
def _first_interrupt_sets(flag: threading.Event):
    """While a reply runs, the first Ctrl-C sets `flag` (the reply stops at its next token) and a second
    one raises KeyboardInterrupt at once. Only the main thread receives signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return

    def on_sigint(_signum, _frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
