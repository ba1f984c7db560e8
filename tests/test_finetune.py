"""Fine-tuning: a run that starts from another's weights (``--init``), and prompt/response
examples (a ``.jsonl`` source) trained on their responses alone."""

import copy
import importlib.util
import inspect
import io
import json
import re
import shutil
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from archlab.engine import Engine
from archlab.study.definition import load_study
from archlab.study.report import starts as starts_said
from archlab.study.runner import StudyChanged, claim, join, planned_as, run_trial, storage_url
from archlab.train.checkpoint import file_hash, load_trained
from archlab.train.config import Data, holds_examples, load_config
from archlab.train.data import DataError, TokenSource, load_tokenizer, prepare, read_examples, reply_prompt, tokens_of
from conftest import ROOT
from test_study import completed
from test_train import SMALL, finished_run


def _functions_script():
    spec = importlib.util.spec_from_file_location("stdlib_functions", ROOT / "docs/examples/stdlib_functions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy_chat(run, messages: list[dict], said: tuple[str, ...], new_tokens: int) -> tuple[str, list[int]]:
    """What ``chat`` on ``run`` should print for the messages ``said`` after ``messages`` (which it
    extends), worked without the engine or ``reply_prompt``: each prompt tokenized message by
    message, each reply greedy by the whole model's logits up to ``new_tokens`` or ``<|end|>``;
    and each prompt's length."""
    tokenizer, (_, model, _, _) = load_tokenizer(str(run / "tokenizer.json"), 256), load_trained(run)
    transcript, lengths = "", []
    for message in said:
        messages.append({"role": "user", "content": message})
        prompt = [i for m in messages for text in (f"{m['role'].title()}: ", m["content"], "<|end|>\n") for i in tokenizer.encode(text).ids]
        prompt += tokenizer.encode("Assistant: ").ids
        lengths.append(len(prompt))
        new = []
        while len(new) < new_tokens and "<|end|>" not in tokenizer.decode(new):
            with torch.no_grad():
                new.append(int(model(torch.tensor([prompt + new]))[0, -1].argmax()))
        messages.append({"role": "assistant", "content": tokenizer.decode(new).partition("<|end|>")[0]})
        transcript += f"User: {message}\n\nAssistant: {messages[-1]['content']}\n" + ("" if messages[-1]["content"].endswith("\n") else "\n")
    return transcript, lengths


def write_examples(path, examples):
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return path


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """Real examples: the documented functions of textwrap, as the shipped script makes them."""
    found = _functions_script().examples(inspect.getsource(textwrap), longest=600)
    assert len(found) >= 8
    return write_examples(tmp_path_factory.mktemp("examples") / "textwrap.jsonl", found)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A finished 4-step run on text, to fine-tune from."""
    return finished_run(tmp_path_factory, *SMALL, "--steps", "4", "--set", "checkpoint_interval=2")


def test_the_script_splits_each_function_after_its_docstring():
    source = textwrap.dedent('''
        class A:
            @staticmethod
            def double(x):
                """Twice x."""
                y = x * 2
                return y

            def bare(self):
                """Only a docstring."""

        def outer():
            return 1
    ''')
    found = _functions_script().examples(source, longest=600)
    assert found == [{"prompt": 'def double(x):\n    """Twice x."""\n', "response": "    y = x * 2\n    return y\n"}]
    assert _functions_script().conversation(found[0]) == {"messages": [  # with --chat
        {"role": "user", "content": 'Write the body of this function.\ndef double(x):\n    """Twice x."""'},
        {"role": "assistant", "content": "    y = x * 2\n    return y\n"}]}
    assert _functions_script().examples(source, longest=10) == []  # the body is 29 characters


def test_a_val_fraction_that_rounds_to_no_example_holds_out_one(tmp_path):
    """Four examples at val_fraction 0.1 (0.4 of one): the last example is held out, not none
    (an empty held-out split could not be evaluated)."""
    path = write_examples(tmp_path / "four.jsonl", [{"prompt": f"p{i} ", "response": f"r{i}"} for i in range(4)])
    data = prepare(Data(source=str(path), val_fraction=0.1), 256, 4, 0, tmp_path)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"), 256)
    assert tokenizer.decode(data.splits["val"].tolist()) == "p3 r3\n"
    assert tokenizer.decode(data.splits["train"].tolist()) == "p0 r0\np1 r1\np2 r2\n"


def test_only_the_responses_and_their_ends_count(examples, tmp_path):
    """The training split's tokens where they count decode to each example's response and the
    newline that ends it, and where they do not, to its prompt; the last examples are held out."""
    pairs = [json.loads(line) for line in examples.read_text().splitlines()]
    cfg = Data(source=str(examples), val_fraction=0.2)
    data = prepare(cfg, 512, 32, 0, tmp_path)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"), 512)
    held = round(len(pairs) * 0.2)
    for split, wanted in (("train", pairs[:-held]), ("val", pairs[-held:])):
        tokens, counted = data.splits[split], data.masks[split]
        edges = np.flatnonzero(np.diff(counted.astype(int))) + 1
        parts = np.split(np.arange(len(tokens)), edges)
        assert not counted[0] and counted[-1] and len(parts) == 2 * len(wanted)
        decoded = [tokenizer.decode(tokens[part].tolist()) for part in parts]
        assert decoded[0::2] == [pair["prompt"] for pair in wanted]
        assert decoded[1::2] == [pair["response"] + "\n" for pair in wanted]
    assert data.reports_accuracy


@pytest.fixture(scope="module")
def conversations(examples, tmp_path_factory):
    """The same functions as conversations, two functions each: a system message, then for each
    function its signature and docstring from the user and its body from the assistant (in every
    other conversation, the first body with a weight of 0: context, not trained on); the first
    function stays a prompt/response line, as a file may mix them."""
    pairs = [json.loads(line) for line in examples.read_text().splitlines()]
    chats = [{"messages": [{"role": "system", "content": "Write the body of each function."}]
              + [message for pair in pairs[first : first + 2] for message in ({"role": "user", "content": pair["prompt"]},
                                                                              {"role": "assistant", "content": pair["response"]})]}
             for first in range(1, len(pairs), 2)]
    for chat in chats[::2]:
        chat["messages"][2]["weight"] = 0
    return write_examples(tmp_path_factory.mktemp("conversations") / "textwrap-chat.jsonl", pairs[:1] + chats)


def test_only_the_assistants_messages_and_their_ends_count(conversations, tmp_path):
    """Where the tokens count they decode to each assistant message (of weight 1) and the end of
    a message after it; where they do not, to the role headers and the other messages, each
    ended alike."""
    lines = [json.loads(line) for line in conversations.read_text().splitlines()]
    data = prepare(Data(source=str(conversations), val_fraction=0.25), 512, 32, 0, tmp_path)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"), 512)
    held = round(len(lines) * 0.25)
    for split, wanted in (("train", lines[:-held]), ("val", lines[-held:])):
        expected = []
        for line in wanted:
            if "prompt" in line:
                expected += [line["prompt"], line["response"] + "\n"]
                continue
            context = ""
            for message in line["messages"]:
                if message["role"] == "assistant" and message.get("weight") != 0:
                    expected += [context + "Assistant: ", message["content"] + "<|end|>\n"]
                    context = ""
                else:
                    context += f"{message['role'].title()}: {message['content']}<|end|>\n"
        tokens, counted = data.splits[split], data.masks[split]
        parts = np.split(np.arange(len(tokens)), np.flatnonzero(np.diff(counted.astype(int))) + 1)
        assert not counted[0] and counted[-1]
        assert [tokenizer.decode(tokens[part].tolist()) for part in parts] == expected
    held_by_two = len(lines[0]["prompt"]) + len(lines[0]["response"]) + sum(len(m["content"]) for m in lines[1]["messages"])
    with pytest.warns(UserWarning, match=f"data source {str(conversations)!r} is read as far as data.max_bytes"):
        assert len(read_examples(str(conversations), held_by_two)) == 2  # max_bytes counts what the lines hold
    with pytest.warns(UserWarning, match="max_bytes"):
        assert len(read_examples(str(conversations), held_by_two + 1)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read whole: nothing to say
        assert len(read_examples(str(conversations), 10**9)) == len(lines)
        ended = conversations.with_name("ended.jsonl")  # blank lines after the last example, which fills the budget, are none
        ended.write_text(conversations.read_text() + "\n\n")
        whole = sum(len(line.get("prompt", "")) + len(line.get("response", "")) + sum(len(m["content"]) for m in line.get("messages", []))
                    for line in lines)
        assert len(read_examples(str(ended), whole)) == len(lines)


def test_a_run_fine_tunes_on_conversations_is_evaluated_and_chats_as_it_trained(cli, pretrained, conversations, tmp_path, monkeypatch):
    """A file of conversations (and a prompt/response line) is fine-tuned on as any examples are;
    ``chat`` replies as greedy decoding by the whole logits does after the conversation so far,
    each header, message and end tokenized on its own as training tokenized them."""
    run = tmp_path / "chat"
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--init", pretrained, "--data", conversations,
                          "--steps", "2", "--set", "seq_len=64", "--set", "batch_size=4", "--set", "micro_batch_size=4")
    assert code == 0, stderr
    assert 0 <= json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["eval_acc"] <= 1
    code, stdout, stderr = cli("evaluate", run, "--seq-len", "64", "--last", "32", "--sequences", "4")
    assert code == 0 and "Traceback" not in stderr, stderr
    header, _, row = (line.split("|")[1:-1] for line in stdout.splitlines())
    row = dict(zip(map(str.strip, header), map(str.strip, row), strict=True))
    assert 0 < int(row["tokens scored"].replace(",", "")) < 4 * 32, stdout  # the assistant's tokens among the last 32 alone
    assert 0 <= float(row["acc"]) <= 1, stdout

    messages = [{"role": "system", "content": "Be brief."}]
    transcript, lengths = greedy_chat(run, messages, ("Write the body of this function.\ndef double(x):", "And another."), 6)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Write the body of this function.\ndef double(x):\n\n\nAnd another.\n"))
    asked = []  # the conversation each reply follows, its replies included
    monkeypatch.setattr("archlab.train.data.reply_prompt",
                        lambda so_far, tokenizer: asked.append(copy.deepcopy(so_far)) or reply_prompt(so_far, tokenizer))
    fed, feed = [], Engine.feed  # where each call into the model starts
    monkeypatch.setattr(Engine, "feed", lambda engine, tokens, start, *rest, **named: fed.append(int(start[0])) or feed(engine, tokens, start, *rest, **named))
    code, stdout, stderr = cli("chat", run, "--system", "Be brief.", "--max-new-tokens", "6")
    assert code in (0, None) and "Traceback" not in stderr and "not on conversations" not in stderr, stderr
    assert stdout == transcript and asked == [messages[:1], messages[:2], messages[:4]]  # the system message checked first
    assert fed.count(0) == 1 and lengths[0] in fed  # the second turn fed from where the first prompt ended
    for errors in ("strict", "surrogateescape"):  # as Python reads stdin in a UTF-8 locale, and in C.UTF-8
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors=errors))  # Latin-1
        code, _, stderr = cli("chat", run)
        assert code == 1 and "the input is not UTF-8 text (byte 0xe9)" in stderr and "Traceback" not in stderr, (errors, stderr)


def test_a_reply_of_many_lines_ends_where_training_ended_a_message(cli, pretrained, monkeypatch):
    """A reply ends at the end of a message (as training wrote one after each), not at its first
    newline: the end is not shown, nor anything that may begin it until it is known not to, and
    the reply joins the conversation without it. The model's tokens are scripted."""
    tokenizer = load_tokenizer(str(pretrained / "tokenizer.json"), 256)
    replies = ["    a = [1 <| 2]\n\n    return a\n<|end|>\nUser: never read", "one line<|end|>"]
    prompts, taken = [], []

    def scripted(engine, given, max_new_tokens, sampling, cache=None, held=0):
        prompts.append(tokenizer.decode(given[0].tolist()))
        for token in tokenizer.encode(replies[len(prompts) - 1]).ids[:max_new_tokens]:
            taken.append(token)
            yield torch.tensor([token]), None, torch.tensor([False])

    monkeypatch.setattr(Engine, "stream", scripted)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Write it.\n\nAnd another.\n"))
    code, stdout, stderr = cli("chat", pretrained)
    assert code in (0, None) and "Traceback" not in stderr and "cut" not in stderr, stderr
    assert f"{pretrained} trained on stdlib, not on conversations: its replies need not end where a message does" in " ".join(stderr.split())
    assert stdout == "User: Write it.\n\nAssistant:     a = [1 <| 2]\n\n    return a\n\nUser: And another.\n\nAssistant: one line\n\n"
    assert prompts[1] == "User: Write it.<|end|>\nAssistant:     a = [1 <| 2]\n\n    return a\n<|end|>\nUser: And another.<|end|>\nAssistant: "
    assert len(taken) == len(tokenizer.encode("    a = [1 <| 2]\n\n    return a\n<|end|>" + replies[1]).ids)  # none read past an end

    prompts.clear()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Write it.\r\n"))  # a line's \r\n ends it, as \n does
    code, stdout, stderr = cli("chat", pretrained, "--max-new-tokens", "5")
    assert code in (0, None) and stdout == "User: Write it.\n\nAssistant:     a\n\n", stdout
    assert prompts == ["User: Write it.<|end|>\nAssistant: "]
    assert "(the reply was cut at --max-new-tokens 5)" in stderr
    typed = io.StringIO("Say <|end|>.\n\nHi.\n")
    typed.isatty = lambda: True  # at a terminal, a message holding the end is typed again, the conversation going on
    monkeypatch.setattr(sys, "stdin", typed)
    prompts.clear()
    code, stdout, stderr = cli("chat", pretrained, "--max-new-tokens", "5")
    assert code in (0, None) and "a message cannot hold <|end|>, which ends a message where the model reads it; type it again" \
        in stderr and prompts == ["User: Hi.<|end|>\nAssistant: "], stderr
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say <|end|>.\n"))
    code, stdout, stderr = cli("chat", pretrained)
    assert code == 1 and "error: a message cannot hold <|end|>, which ends a message where the model reads it" in stderr, stderr  # piped
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi.\n"))
    code, stdout, stderr = cli("chat", pretrained, "--system", "End with <|end|>.")
    assert code == 2 and "Invalid value for '--system': holds <|end|>, which ends a message where the model reads it; take it" \
        in " ".join(stderr.replace("│", "").split()) and "Traceback" not in stderr, stderr  # was its "message 1"
    assert stdout == "" and sys.stdin.tell() == 0  # refused before a message was read


def test_each_reply_of_a_seeded_chat_draws_its_own_random_numbers(cli, pretrained, monkeypatch):
    """One --seed for every reply gave each the first reply's draws: a token chosen at a quantile
    in one was chosen at that quantile in all. Reply N samples from seed + N - 1, still repeatable."""
    from archlab.train.config import SEED_LIMIT

    seeds = []

    def scripted(engine, given, max_new_tokens, sampling, cache=None, held=0):
        seeds.append(sampling.seed)
        yield torch.tensor([0]), None, torch.tensor([False])

    monkeypatch.setattr(Engine, "stream", scripted)
    for seed, drawn in ((None, [None, None, None]), (7, [7, 8, 9]), (SEED_LIMIT - 2, [SEED_LIMIT - 2, SEED_LIMIT - 1, 0])):
        seeds.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO("One.\n\nTwo.\n\nThree.\n"))
        code, _, stderr = cli("chat", pretrained, "--temperature", "1", *(["--seed", seed] if seed is not None else []))
        assert code in (0, None) and seeds == drawn, (seed, seeds, stderr)


def test_text_decodes_back_with_the_special_tokens_it_was_encoded_with(pretrained, tmp_path):
    """A user's tokenizer may hold <|end|> as a special token (Phi-3's does): training encodes it as
    that one id, and decoding skipped it, so no reply of chat ever ended, nor --stop met one."""
    from archlab.cli import TextCodec

    tokenizer = load_tokenizer(str(pretrained / "tokenizer.json"), 256)
    tokenizer.add_special_tokens(["<|end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path / "tokenizer.json", 512)
    ids = codec.encode("Yo<|end|>\n")
    assert tokenizer.token_to_id("<|end|>") in ids and codec.decode(ids) == "Yo<|end|>\n"


def test_a_typed_message_keeps_the_indentation_of_its_lines():
    """A message is its lines up to a blank line, each without its line ending alone: code typed
    into chat keeps its indentation (and a line of spaces alone ends the message, as a blank one does)."""
    from archlab.cli import _messages

    typed = io.StringIO("def f(x):\n    return x\r\n   \n  indented\n")
    assert list(_messages(typed)) == ["def f(x):\n    return x", "  indented"]


def test_chat_refuses_a_cache_without_room_before_the_reply_begins(cli, pretrained, monkeypatch):
    import archlab.memory

    monkeypatch.setattr(archlab.memory, "free_bytes", lambda device: 8 * 2**20)  # the weights fit, 10,000 positions do not
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi.\n"))
    code, stdout, stderr = cli("chat", pretrained, "--max-new-tokens", 10_000)
    assert code == 1 and "new tokens and room for 10,028 more does not fit in memory (a cache's states (1 sequence of up to " in stderr, stderr
    assert stdout == "User: Hi.\n\n"  # and no "Assistant: " left without its line's end


def test_a_conversation_that_outgrows_its_cache_goes_on_in_a_new_one(cli, pretrained, monkeypatch):
    """Chat's first cache has room for twice its first turn: a message past that is prefilled
    afresh into a new cache, and the turn after goes on in that one; each reply is still greedy
    decoding by the whole logits after the conversation so far."""
    said = ("Hi.", " ".join(["word"] * 40), "Go on.")
    transcript, lengths = greedy_chat(pretrained, [], said, 3)
    assert lengths[1] + 3 > 2 * (lengths[0] + 3) and lengths[2] + 3 <= 2 * (lengths[1] + 3)  # outgrows the first cache, not the second
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n".join(said) + "\n"))
    fed, feed = [], Engine.feed  # where each call into the model starts
    monkeypatch.setattr(Engine, "feed", lambda engine, tokens, start, *rest, **named: fed.append(int(start[0])) or feed(engine, tokens, start, *rest, **named))
    code, stdout, stderr = cli("chat", pretrained, "--max-new-tokens", "3")
    assert code in (0, None) and "Traceback" not in stderr, stderr
    assert stdout == transcript
    assert fed.count(0) == 2 and lengths[1] in fed  # the second turn in a new cache; the third fed from where the second prompt ended


@pytest.mark.parametrize("over", [0, 1], ids=["filled", "one past"])
def test_chat_keeps_its_cache_while_the_next_turn_fits_and_not_a_position_past(cli, pretrained, monkeypatch, over):
    """The first turn's cache has room for its prompt and reply twice over; the next turn feeds
    only what it adds where its prompt and --max-new-tokens fill that room exactly, and starts a
    fresh cache where they need one position more (the reply would run past the cache's end).
    The model's tokens are scripted; the run's tokenizer is byte-level, so each "x" is a token."""
    tokenizer, new = load_tokenizer(str(pretrained / "tokenizer.json"), 256), 16
    first = [{"role": "user", "content": "Hi."}]
    capacity = 2 * (len(reply_prompt(first, tokenizer)) + new)
    so_far = [*first, {"role": "assistant", "content": "one"}]
    room = capacity - new - len(reply_prompt([*so_far, {"role": "user", "content": ""}], tokenizer))
    second = "x" * (room + over)
    assert len(reply_prompt([*so_far, {"role": "user", "content": second}], tokenizer)) + new == capacity + over
    calls = []

    def scripted(engine, given, max_new_tokens, sampling, cache=None, held=0):
        calls.append((cache.capacity, held))
        for token in tokenizer.encode("one<|end|>").ids:
            yield torch.tensor([token]), None, torch.tensor([False])

    monkeypatch.setattr(Engine, "stream", scripted)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hi.\n\n{second}\n"))
    code, stdout, stderr = cli("chat", pretrained, "--max-new-tokens", new)
    assert code in (0, None) and stdout.count("Assistant: one\n") == 2, stderr
    second_prompt = capacity + over - new
    kept, fresh = (capacity, len(reply_prompt(first, tokenizer))), (2 * (second_prompt + new), 0)  # fed from its end, or from 0
    assert calls == [(capacity, 0), fresh if over else kept]


def test_a_reply_follows_the_conversation_tokenized_as_training_tokenized_it():
    """Piece by piece: with a BPE whose tokens join a space to the word after it, the conversation
    read as one text would start its messages with tokens training never saw there."""
    from archlab.train.data import read_texts, train_tokenizer

    tokenizer = train_tokenizer(read_texts("stdlib", 400_000), 2048)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write the body of this function.\ndef double(x):"},
                {"role": "assistant", "content": "    return 2 * x", "weight": 0}, {"role": "user", "content": "And another."}]
    pieces = [text for m in messages for text in (f"{m['role'].title()}: ", m["content"], "<|end|>\n")] + ["Assistant: "]
    assert reply_prompt(messages, tokenizer) == [i for text in pieces for i in tokenizer.encode(text).ids]
    assert reply_prompt(messages, tokenizer) != tokenizer.encode("".join(pieces)).ids


def test_a_window_counts_the_targets_its_mask_marks():
    """Tokens that are their own positions show which stream positions each row took."""
    tokens, counted = np.arange(1000), np.random.default_rng(0).random(1000) < 0.5
    data = TokenSource(tokens, tokens, 16, 0, "numbers", masks={"train": counted, "val": counted})
    batch = data.batch("train", 3, 8)
    assert torch.equal(batch.targets, batch.inputs + 1)
    assert torch.equal(batch.mask, torch.from_numpy(counted[batch.targets.numpy()]))
    assert torch.equal(batch.counted_targets() == -100, torch.from_numpy(~counted[batch.targets.numpy()]))


def test_the_share_of_windows_that_count_nothing_is_that_of_the_windows_batches_draw():
    counted = np.random.default_rng(1).random(2000) < 0.02
    data = TokenSource(np.arange(2000), np.arange(2000), 24, 0, "numbers", masks={"train": counted, "val": counted})
    drawn = np.concatenate([data.batch("train", step, 64).mask.numpy() for step in range(200)])  # 12,800 windows
    share = data.uncounted_share()
    assert share == np.mean([not counted[s + 1 : s + 25].any() for s in range(2000 - 24)])
    assert 0.3 < share < 0.9 and abs(np.mean(~drawn.any(axis=1)) - share) < 0.02



def test_a_window_counts_its_targets_not_its_inputs_at_the_ends_of_the_tokens():
    """A window from s reads inputs s..s+n-1 and counts targets s+1..s+n. By hand, windows of 4
    over 10 tokens start at 0..5; with positions 0 and 5 counted, those from 0 and 5 count
    nothing (0 is only ever an input, and the window from 5 reads 5 as an input), the other 4
    count 5. A random mask, as above, tells a window shifted by one from the right one only at
    the two ends of the tokens."""
    counted = np.zeros(10, dtype=bool)
    counted[[0, 5]] = True
    data = TokenSource(np.arange(10), np.arange(10), 4, 0, "numbers", masks={"train": counted, "val": counted})
    assert data.uncounted_share() == 2 / 6


def test_a_tokenizers_template_adds_no_token_inside_examples_or_prompts(tmp_path):
    """A tokenizer.json that puts a start token before every encoding, as Llama's does: examples
    are joined from pieces tokenized apart, so it would stand before each response, and count."""
    from tokenizers import processors

    from archlab.cli import TextCodec
    from archlab.train.data import _example_tokens, train_tokenizer

    tokenizer = train_tokenizer(["Q: one two three\nA: four five\n"] * 20, 300)
    tokenizer.add_special_tokens(["<s>"])
    start = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", start)])
    assert tokenizer.encode("four").ids[0] == start
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (ids,), (counted,) = _example_tokens([[("Q: one two", False), ("A: four five", True), ("\n", True)]],
                                         load_tokenizer(str(tmp_path / "tokenizer.json"), 512))
    assert start not in ids and counted.sum() == len(tokenizer.encode("A: four five\n", add_special_tokens=False).ids)
    assert start not in TextCodec(tmp_path / "tokenizer.json", 512).encode("Q: one two")


def test_a_step_whose_windows_count_no_token_makes_no_update(pretrained, tmp_path, monkeypatch):
    """Prompts longer than seq_len: many windows lie inside them. A step whose whole batch counts
    no token logs no loss and leaves the weights as they were, which AdamW's weight decay and
    momentum would move with nothing learned. The memory watch waits for a step that runs."""
    from contextlib import nullcontext

    from rich.console import Console
    from safetensors.torch import load_file

    import archlab.train.trainer
    from archlab.spec import load_spec
    from archlab.train.config import TrainConfig
    from archlab.train.trainer import Trainer

    watched = []
    monkeypatch.setattr(archlab.train.trainer, "Watched", lambda device, what: watched.append(what) or nullcontext())

    long = write_examples(tmp_path / "long.jsonl", [{"prompt": f"x{i} = {i}\n" * 16, "response": f"y = {i} * 2 + 1"} for i in range(8)])
    cfg = TrainConfig.model_validate({"batch_size": 2, "micro_batch_size": 1, "seq_len": 16, "log_interval": 1, "eval_interval": 100,
                                      "checkpoint_interval": 1, "keep_checkpoints": 8, "init": str(pretrained),
                                      "data": {"source": str(long), "val_fraction": 0.25}})
    console = Console(file=io.StringIO(), width=500)
    records = Trainer(load_spec(ROOT / "specs/tiny/transformer.yaml"), cfg, tmp_path / "run", console).fit(8)
    data = prepare(load_config(str(tmp_path / "run/config.yaml")).data, 256, 16, 0, tmp_path / "run", resume=True)
    counts = [int(data.batch("train", step, 2).mask.sum()) for step in range(8)]
    assert counts[0] == 0 and any(counts)
    assert len(watched) == [bool(c) for c in counts].index(True) + 1
    assert [("loss" in record, "grad_norm" in record) for record in records] == [(bool(c), bool(c)) for c in counts]
    weights = [load_file(pretrained / "checkpoints/step-00000004/model.safetensors")]
    weights += [load_file(tmp_path / f"run/checkpoints/step-{step:08d}/model.safetensors") for step in range(1, 9)]
    unchanged = [all(torch.equal(before[name], after[name]) for name in before) for before, after in zip(weights, weights[1:])]
    assert unchanged == [not c for c in counts]
    said = " ".join(console.file.getvalue().split())
    assert f"{data.uncounted_share():.0%} of the training windows of 16 tokens hold no token that counts" in said
    assert "no token counted, no update" in said


def test_fine_tuning_starts_from_the_runs_weights_and_counts_the_responses(cli, pretrained, examples, tmp_path):
    """The first step's loss is the pretrained model's cross-entropy on the responses of the
    first batch, from the whole logits; the run records the checkpoint it started from and reads
    text with that run's tokenizer."""
    run = tmp_path / "tuned"
    settings = ["--set", "seq_len=64", "--set", "batch_size=4", "--set", "micro_batch_size=4", "--set", "log_interval=1",
                "--set", "eval_batches=1", "--set", "checkpoint_interval=2"]
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--init", pretrained, "--data", examples,
                          "--steps", "4", *settings)
    assert code == 0, stderr
    started = pretrained / "checkpoints/step-00000004"
    assert f"starting from the weights of {started} (step 4)" in " ".join(stderr.split())
    cfg = load_config(str(run / "config.yaml"))
    assert cfg.init == str(started) and cfg.data.tokenizer == str(pretrained / "tokenizer.json")
    assert (run / "tokenizer.json").read_text() == (pretrained / "tokenizer.json").read_text()

    _, model, _, _ = load_trained(pretrained)
    data = prepare(cfg.data, 256, 64, cfg.seed, run, resume=True)
    read_whole, counted = tokens_of(cfg.data, 256, run / "tokenizer.json")  # as `evaluate --data` reads examples
    assert np.array_equal(read_whole, np.concatenate([data.splits["train"], data.splits["val"]]))
    assert np.array_equal(counted, np.concatenate([data.masks["train"], data.masks["val"]]))
    batch = data.batch("train", 0, 4)
    with torch.no_grad():
        logits = model(batch.inputs)
    wanted = F.cross_entropy(logits.flatten(0, 1), batch.counted_targets().flatten(), ignore_index=-100).item()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(wanted, rel=1e-5)
    assert 0 <= records[-1]["eval_acc"] <= 1

    resumed = tmp_path / "resumed"  # from its step-2 checkpoint, as after a crash: the same steps 3 and 4
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints/step-00000004")
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", resumed, "--resume", "--steps", "4")
    assert code == 0, stderr
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again] == [r["loss"] for r in records]

    code, stdout, stderr = cli("generate", run, "--prompt", "def f(x):\n", "--max-new-tokens", "8")
    assert code == 0, stderr
    code, _, stderr = cli("curves", pretrained, run)
    said = " ".join(stderr.split())
    assert code in (0, None) and f"- tuned was fine-tuned from {started}: its steps, tokens and FLOPs count from there" in said, stderr
    assert "- run was fine-tuned" not in said  # the starting run itself was not


def test_a_different_spec_whose_weights_fit_is_said(cli, pretrained, tmp_path):
    spec = tmp_path / "wide-rope.yaml"
    spec.write_text(yaml.safe_dump({"extends": str(ROOT / "specs/tiny/transformer.yaml"),
                                    "layout": {"layers": {"position": {"theta": 500000}}}}))
    earlier = pretrained / "checkpoints/step-00000002"  # a checkpoint folder of its own choosing, not the run's latest
    code, _, stderr = cli("train", spec, "--out", tmp_path / "run", "--init", earlier, "--steps", "1", *SMALL)
    assert code == 0, stderr
    said = " ".join(stderr.split())
    assert f"starting from the weights of {earlier} (step 2)" in said and load_config(str(tmp_path / "run/config.yaml")).init == str(earlier)
    assert "its spec differs from this one, whose weights it fits (layout.layers.position.theta 10000 -> 500000)" in said


def test_a_checkpoint_copied_under_a_name_of_its_own_starts_a_run(cli, pretrained, tmp_path):
    """A folder the trainer did not name gives no step: a run starts from it all the same, and one
    whose weights are not the bytes saved with them is refused by name."""
    kept = tmp_path / "copy/checkpoints/before-the-change"
    shutil.copytree(pretrained, tmp_path / "copy")
    shutil.copytree(pretrained / "checkpoints/step-00000004", kept)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--init", kept, "--steps", "1", *SMALL)
    assert code == 0, stderr
    assert f"starting from the weights of {kept}; the optimizer" in " ".join(stderr.split())
    state = json.loads((kept / "state.json").read_text())
    (kept / "state.json").write_text(json.dumps({**state, "weights_blake2b": "0" * len(state["weights_blake2b"])}))
    refused_unwritten(cli, tmp_path / "again", ["specs/tiny/transformer.yaml", "--init", kept],
                      f"checkpoint {kept} is damaged (its model.safetensors is not the file saved with it: a hash of its bytes differs)")


def refused(cli, out, args, *fragments):
    """A training start refused with a message holding ``fragments``, before its first step."""
    code, _, stderr = cli("train", *args, "--out", out, "--steps", "2", *SMALL)
    said = " ".join(stderr.split())
    assert code == 1 and all(fragment in said for fragment in fragments) and "Traceback" not in stderr, stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def refused_unwritten(cli, out, args, *fragments):
    """Refused before the run folder is made: starting weights are checked before anything is written."""
    refused(cli, out, args, *fragments)
    assert not out.exists()


def test_starting_weights_that_do_not_fit_are_refused(cli, pretrained, tmp_path):
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/yoco-u.yaml", "--init", pretrained], "does not fit this model",
                      f"fine-tuning needs a spec whose weights are those of the run it starts from, shape for shape ({pretrained / 'spec.yaml'}")
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--init", tmp_path],
                      f"{tmp_path} is not a training run with a checkpoint")
    damaged = tmp_path / "damaged"
    shutil.copytree(pretrained, damaged)
    (damaged / "checkpoints/step-00000004/model.safetensors").write_bytes(b"\0" * 64)
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--init", damaged],  # it said "remove it to resume"
                      f"checkpoint {damaged / 'checkpoints/step-00000004'} is damaged (",
                      f"); give --init the one before it, {damaged / 'checkpoints/step-00000002'}")
    assert "fine-tuning needs" not in cli("train", "specs/tiny/transformer.yaml", "--init", damaged, "--out", tmp_path / "run")[2]


def test_another_tokenizer_than_the_starting_runs_is_refused(cli, pretrained, examples, tmp_path):
    from tokenizers import Tokenizer, models

    other = tmp_path / "words.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "?": 2}, unk_token="?")).save(str(other))
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--init", pretrained, "--data", examples,
                                              "--set", f"data.tokenizer={other}"],
                      f"data.tokenizer {other} is not the tokenizer of {pretrained}")
    same = tmp_path / "same.json"
    shutil.copy(pretrained / "tokenizer.json", same)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--init", pretrained, "--data", examples, "--set",
                          f"data.tokenizer={same}", "--out", tmp_path / "run", "--steps", "1", *SMALL)
    assert code == 0, stderr


def test_a_starting_runs_tokenizer_that_does_not_load_stops_the_start_before_it_writes(cli, pretrained, examples, tmp_path):
    """It was first read as the corpus was tokenized, after the new run's spec, config and settings were written."""
    start = tmp_path / "start"
    shutil.copytree(pretrained, start)
    (start / "tokenizer.json").write_text("garbage")
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--init", start, "--data", examples],
                      f"tokenizer {str(start / 'tokenizer.json')!r} could not be read")


def test_a_run_on_token_ids_gives_no_tokenizer_to_fine_tune_on_text(cli, examples, tmp_path_factory, tmp_path):
    on_mqar = finished_run(tmp_path_factory, "--data", "mqar", "--set", "seq_len=32", "--set", "batch_size=4",
                           "--set", "micro_batch_size=4", "--steps", "1")
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--init", on_mqar, "--data", examples],
                      "trained on token ids or a recall task, with no tokenizer", "give data.tokenizer")
    code, _, stderr = cli("chat", on_mqar)
    assert code == 1 and "with no tokenizer to read a conversation with" in stderr and "Traceback" not in stderr, stderr


def test_a_resume_keeps_its_starting_weights(cli, pretrained, tmp_path):
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--init", pretrained, "--steps", "1", *SMALL)
    assert code == 0, stderr
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--resume", "--init", pretrained, "--steps", "2")
    assert code == 1 and "drop --config, --data and --init" in " ".join(stderr.split())
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--resume", "--set", f"init={tmp_path}", "--steps", "2")
    assert code == 1 and "a resumed run keeps its init" in " ".join(stderr.split()), stderr


@pytest.mark.parametrize("lines, said", [
    (['{"prompt": "a", "response": "b"}', "{not json", '{"prompt": "c", "response": "d"}'], "line 2 of {path!r} is not JSON"),
    (['{"prompt": "a", "response": "b"}', '{"prompt": "c", "answer": "d"}'],
     'line 2 of {path!r} is not an example: each line is a JSON object with "prompt" and "response" strings, or with "messages",'
     ' it has {{"prompt": "c", "answer": "d"}}'),
    (['{"prompt": "a", "response": "b"}', "", '["c", "d"]'], "line 3 of {path!r} is not an example"),
    (['{"prompt": "a", "response": "b"}', '{"messages": "hi"}'], 'line 2 of {path!r}: "messages" is a list of {{"role", "content"}} objects, it has "hi"'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}'],
     'line 2 of {path!r}: message 2 is not a {{"role": "system" | "user" | "assistant", "content": string}} object, it is'
     ' {{"role": "tool", "content": "b"}}'),
    (['{"messages": [{"role": "assistant", "content": [{"type": "text", "text": "b"}]}]}'], "line 1 of {path!r}: message 1 is not a"),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}'],
     'line 2 of {path!r} has no assistant message to train on (none, or each with "weight": 0)'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]}'],
     'line 2 of {path!r} has no assistant message to train on'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "b"}]}'],
     'line 2 of {path!r}: message 1 has "weight": 1; an assistant\'s message may have a weight of 0 (context, not trained on) or 1'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "assistant", "content": "b", "weight": 0.5}]}'],
     'line 2 of {path!r}: message 1 has "weight": 0.5'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "assistant", "content": "b", "weight": true}]}'],
     'line 2 of {path!r}: message 1 has "weight": true'),
    (['{"prompt": "a", "response": "b"}', '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b<|end|>c"}]}'],
     "line 2 of {path!r}: message 2 holds <|end|>, which ends a message where the model reads it (and, in training, learns to end"
     " one there); take it out of the content"),
    (['{"prompt": "a", "response": "b"}'], "data source {path!r} holds 1 example(s); training and validation need at least one each"),
    (['{"prompt": "a", "response": "b"}', '{"prompt": "\\ud800", "response": "b"}'],
     'line 2 of {path!r} holds "\\ud800", half of a UTF-16 surrogate pair, which is not text'),
    (['{"prompt": "a", "response": "b"}', "[" * 100_000 + "]" * 100_000], "line 2 of {path!r} is not an example: its JSON nests too deeply"),
])
def test_examples_that_do_not_read_are_named_by_their_line(cli, tmp_path, lines, said):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    refused(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--data", path], said.format(path=str(path)))


def test_examples_to_score_are_refused_only_where_there_are_none(cli, pretrained, tmp_path):
    """Scoring read examples as training does, and refused a file of one because "training and
    validation need at least one each", which evaluate and niah do not do."""
    one, none = tmp_path / "one.jsonl", tmp_path / "none.jsonl"
    one.write_text('{"prompt": "a question", "response": "' + "an answer " * 20 + '"}\n')
    none.write_text("\n")
    code, stdout, stderr = cli("evaluate", pretrained, "--data", one, "--seq-len", "16", "--last", "8")
    assert code in (0, None) and "| 16 |" in stdout, stderr
    for command in (["evaluate", pretrained, "--seq-len", "16", "--last", "8"], ["niah", pretrained, "--haystack", "text"]):
        code, _, stderr = cli(*command, "--data", none)
        assert code == 1 and f"data source {str(none)!r} holds 0 example(s); there is nothing to score" in stderr, stderr
    code, _, stderr = cli("niah", pretrained, "--haystack", "text", "--data", "mqar")  # "data source 'mqar': no such file or folder"
    assert code == 1 and "--data mqar: a recall task is token ids, and a haystack is text" in stderr, stderr


def test_examples_not_utf8_are_named_by_their_line(cli, tmp_path):
    """Decoded ahead of the lines, the file's error named no line, where every other one does."""
    path = tmp_path / "latin1.jsonl"
    good = b'{"prompt": "a", "response": "b"}\n'
    path.write_bytes(good * 300 + '{"prompt": "caf\u00e9", "response": "b"}\n'.encode("latin-1") + good)
    refused(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--data", path],
            f"line 301 of {str(path)!r} is not UTF-8 text (byte 0xe9); convert the file to UTF-8")


def test_examples_read_whatever_their_files_suffix_case_or_byte_order_mark(examples, tmp_path):
    """JSON Lines by either name, in either case, with or without a byte-order mark; too few examples
    within max_bytes say that it cut them short."""
    text = examples.read_text()
    for name, data in (("upper.JSONL", text), ("lines.ndjson", text), ("marked.jsonl", "\ufeff" + text)):
        (tmp_path / name).write_text(data, encoding="utf-8")
        assert holds_examples(str(tmp_path / name)) and read_examples(str(tmp_path / name), 10**9) == read_examples(str(examples), 10**9)
    with pytest.raises(DataError, match=r"holds 1 example\(s\) within data.max_bytes \(10 characters\)"):
        read_examples(str(examples), 10)


def test_examples_are_read_until_their_characters_reach_max_bytes_and_no_further(tmp_path):
    """max_bytes counts the prompt and response characters of the examples read: the example that
    brings the count to exactly max_bytes is the last one read, and the rest are cut (and said to be)."""
    path = write_examples(tmp_path / "four.jsonl", [{"prompt": "ab", "response": "cde"}] * 4)  # 5 characters each
    with pytest.warns(UserWarning, match="is read as far as data.max_bytes"):
        assert len(read_examples(str(path), 10)) == 2
    with pytest.warns(UserWarning, match="is read as far as data.max_bytes"):
        assert len(read_examples(str(path), 11)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_examples(str(path), 20)) == 4  # every one read: nothing cut


def test_examples_are_not_cached(cli, examples, tmp_path):
    refused_unwritten(cli, tmp_path / "run", ["specs/tiny/transformer.yaml", "--data", examples, "--set", f"data.cache={tmp_path}"],
                      "data.cache", "examples are tokenized at each start, into no cache; drop data.cache")
    with pytest.raises(DataError, match="no such file"):
        prepare(Data(source=str(tmp_path / "none.jsonl")), 256, 32, 0, tmp_path)


def test_a_study_fine_tunes_each_trial_from_one_run(cli, pretrained, examples, tmp_path):
    """A study whose training config names ``init`` and examples: every trial starts from that
    run's weights and reads the examples with its tokenizer, in a folder of its own."""
    import optuna

    def study(source, init=pretrained):
        definition = {"schema_version": 1, "name": "tune", "baseline": "transformer", "variants": {"transformer": {"spec": "transformer.yaml"}},
                      "seeds": [0], "lr": {"low": 0.001, "high": 0.002, "points": 2},
                      "scales": {"tiny": {"specs": str(ROOT / "specs" / "tiny"), "train": {
                          "steps": 2, "batch_size": 4, "micro_batch_size": 4, "seq_len": 64, "eval_interval": 2, "eval_batches": 1,
                          "log_interval": 1, "checkpoint_interval": 1000, "keep_checkpoints": 1, "init": str(init),
                          "data": {"source": str(source)}}}}}
        path = tmp_path / "tune.yaml"
        path.write_text(yaml.safe_dump(definition))
        return path

    code, _, stderr = cli("study", "run", study(examples, init=tmp_path / "nowhere"), "--out", tmp_path / "lost")
    said = " ".join(stderr.split())
    assert code == 1 and "scales.tiny.train.init" in said and f"{tmp_path / 'nowhere'} is not a training run" in said, stderr
    bad = write_examples(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}])
    code, _, stderr = cli("study", "run", study(bad), "--out", tmp_path / "bad")
    said = " ".join(stderr.split())
    assert code == 1 and "holds 1 example(s)" in said and "Traceback" not in said, stderr
    assert f"study tune reads it at scale tiny (scales.tiny.train.data in {tmp_path / 'tune.yaml'}" in said  # where to mend it
    code, _, stderr = cli("study", "run", study(examples), "--out", tmp_path / "bad", "--data", bad)
    said = " ".join(stderr.split())
    assert code == 1 and "holds 1 example(s)" in said and said.endswith("(given with --data)"), stderr
    assert "scales.tiny.train.data" not in said  # the study is not where to mend it
    out = tmp_path / "out"
    code, stdout, stderr = cli("study", "run", study(examples), "--out", out)
    assert code in (0, None), stderr
    trials = optuna.load_study(study_name="tune-tiny", storage=f"sqlite:///{out / 'optuna.db'}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    folders = sorted((out / "trials").glob("*/*"))
    assert len(folders) == 2 and not (out / "tokenizer.json").exists()
    for folder in folders:
        cfg = load_config(str(folder / "config.yaml"))
        assert (cfg.init, cfg.data.cache) == (str(pretrained / "checkpoints/step-00000004"), None)
        assert (folder / "tokenizer.json").read_text() == (pretrained / "tokenizer.json").read_text()
        assert "eval_acc" in (folder / "metrics.jsonl").read_text()
    # the report gives the best rate's response accuracy beside its loss, from the trial's last evaluation
    best = min(trials, key=lambda t: t.value)
    last = [r for r in map(json.loads, Path(best.user_attrs["run"], "metrics.jsonl").read_text().splitlines()) if "eval_acc" in r][-1]
    assert last["eval_loss"] == best.value
    header, _, row = (line for line in stdout.splitlines() if line.startswith("|"))
    assert dict(zip(header.split(" | "), row.split(" | ")))["accuracy"] == f"{last['eval_acc']:.1%}", stdout
    assert "; accuracy: of the tokens scored (responses or answers) at the last evaluation" in stdout


def test_a_steps_loss_is_the_mean_over_the_responses_of_the_whole_batch(pretrained, examples, tmp_path):
    """Windows of packed examples count unequal numbers of response tokens: however the batch is
    split into passes, a step's loss is the mean over all of them, and so is its gradient."""
    from rich.console import Console
    from safetensors.torch import load_file

    from archlab.spec import load_spec
    from archlab.train.config import TrainConfig
    from archlab.train.trainer import Trainer

    def first_step(micro: int):
        cfg = TrainConfig.model_validate({"batch_size": 8, "micro_batch_size": micro, "seq_len": 32, "log_interval": 1, "eval_interval": 100,
                                          "checkpoint_interval": 1, "init": str(pretrained), "data": {"source": str(examples)}})
        run = tmp_path / f"micro{micro}"
        (record,) = Trainer(load_spec(ROOT / "specs/tiny/transformer.yaml"), cfg, run, Console(quiet=True)).fit(1)
        return record["loss"], load_file(run / "checkpoints/step-00000001/model.safetensors"), run

    whole, after, run = first_step(8)
    split, after_split, _ = first_step(2)
    _, model, _, _ = load_trained(pretrained)
    batch = prepare(load_config(str(run / "config.yaml")).data, 256, 32, 0, run, resume=True).batch("train", 0, 8)
    counted = [int(row.sum()) for row in batch.mask.view(4, -1)]
    assert len(set(counted)) > 1  # the passes of two sequences count unequal numbers of tokens
    with torch.no_grad():
        wanted = F.cross_entropy(model(batch.inputs).flatten(0, 1), batch.counted_targets().flatten(), ignore_index=-100).item()
    assert whole == pytest.approx(wanted, rel=1e-5) and split == pytest.approx(wanted, rel=1e-5)
    assert all(torch.allclose(after[name], after_split[name], rtol=1e-4, atol=1e-6) for name in after)


def test_two_processes_fine_tune_as_one_does(cli, pretrained, examples, tmp_path):
    """Under torchrun each process counts the response tokens of its share: the step's loss and
    gradient are still the mean over the whole batch's."""
    import os
    import subprocess
    import sys

    common = ["--init", str(pretrained), "--data", str(examples), "--set", "seq_len=32", "--set", "batch_size=8", "--set",
              "micro_batch_size=2", "--set", "log_interval=1", "--set", "eval_interval=1000", "--steps", "3"]
    one = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "one", *common)
    assert one[0] == 0, one[2]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "archlab", "train",
                          "specs/tiny/transformer.yaml", "--out", str(tmp_path / "two"), *common],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr
    a, b = ([json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("one", "two"))
    assert len(a) == 3 and b == pytest.approx(a, rel=1e-4)


def test_evaluate_scores_the_responses_among_the_last_tokens_of_examples(cli, pretrained, examples, tmp_path):
    """An examples run's windows count their responses only, among the last tokens, as training does."""
    from archlab.train.evaluate import Loaded, evaluate, windows

    positions, counted = np.arange(500), np.random.default_rng(1).random(500) < 0.4
    (window,) = windows(positions, [40], 6, counted=counted).values()  # tokens that are their own positions
    assert torch.equal(window.mask, torch.from_numpy(counted[window.targets.numpy()]))

    run = tmp_path / "tuned"
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--init", pretrained, "--data", examples, "--steps", "1",
                          "--set", "seq_len=64", "--set", "batch_size=4", "--set", "micro_batch_size=4", "--set", "data.val_fraction=0.3")
    assert code == 0, stderr
    found = evaluate(run, [32, 64], 16, 4, torch.device("cpu"))
    _, model, _, _ = load_trained(run)
    for result, (length, batch) in zip(found, Loaded.of(run).sequences([32, 64], 4).items(), strict=True):
        targets = batch.targets.masked_fill(~batch.mask, -100)
        targets[:, :-16] = -100
        with torch.no_grad():
            logits = model(batch.inputs)
        wanted = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        assert result.length == length and result.scored == int((targets != -100).sum()) < 4 * 16
        assert result.loss == pytest.approx(wanted.item(), rel=1e-5)
        assert result.accuracy == int((logits.argmax(-1) == targets).sum()) / result.scored  # as training's eval_acc

    short, long = {"prompt": "a", "response": "b" * 10}, {"prompt": "x = 1\n" * 10, "response": "y"}
    prompts = write_examples(tmp_path / "prompts.jsonl", [short] * 6 + [long] + [short] * 3)  # held out: the last 4
    run = tmp_path / "prompts"
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--init", pretrained, "--data", prompts, "--steps", "1",
                          "--set", "seq_len=64", "--set", "batch_size=4", "--set", "micro_batch_size=4", "--set", "data.val_fraction=0.4")
    assert code == 0, stderr
    code, _, stderr = cli("evaluate", run, "--seq-len", "32", "--last", "1", "--sequences", "1")  # its window ends in the prompt
    assert code == 1 and "no response token is among the last 1 of the 32-token windows" in stderr and "Traceback" not in stderr, stderr


def test_an_evaluation_with_no_response_token_says_so(cli, tmp_path):
    """Two examples whose prompts are long and responses empty: the held-out windows drawn miss its one counted token."""
    sparse = write_examples(tmp_path / "sparse.jsonl", [{"prompt": "x = 1\n" * 40, "response": ""}] * 2)
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", tmp_path / "run", "--data", sparse, "--steps", "2", *SMALL,
                          "--set", "data.val_fraction=0.4")
    said = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr and "nan" not in said, stderr
    assert "the evaluation's 2 batches held no token that counts (the responses of 2 examples of" in said
    assert "hold out more (data.val_fraction) or raise eval_batches" in said


def study_file(path, variants, seeds, points=1, steps=2, baseline="yoco", **train):
    """A study of tiny specs on a little of the stdlib."""
    definition = {"schema_version": 1, "name": path.stem, "baseline": baseline, "variants": variants, "seeds": seeds,
                  "lr": {"low": 0.001, "high": 0.004, "points": points},
                  "scales": {"tiny": {"specs": str(ROOT / "specs" / "tiny"), "train": {
                      "steps": steps, "batch_size": 4, "micro_batch_size": 4, "seq_len": 32, "eval_interval": steps, "eval_batches": 1,
                      "log_interval": 1, "checkpoint_interval": 1000, "keep_checkpoints": 1,
                      "data": {"source": "stdlib", "max_bytes": 200_000}, **train}}}}
    path.write_text(yaml.safe_dump(definition))
    return path


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options, as join opens it
def test_each_variant_of_a_study_fine_tunes_from_its_own_pretrained_trials(cli, tmp_path, monkeypatch):
    """The paper's Figure 3 as a study: each variant's trial of each seed starts from the trial of
    that variant and seed which the pretraining study's report chose (its best learning rate), and
    reads text with that trial's tokenizer; trials recorded before they kept their folder are
    found in the pretraining study's default folder."""
    import sqlite3

    import optuna

    monkeypatch.chdir(tmp_path)  # the pretraining study in its default folder, runs/studies/pre-tiny
    both = {"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}}
    pre = study_file(tmp_path / "pre.yaml", both, seeds=[0, 1], points=2, steps=4)
    tuned = {name: {**variant, "init": {"study": "pre.yaml"}} for name, variant in both.items()}
    tune = study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1])

    code, _, stderr = cli("study", "run", tune, "--out", tmp_path / "early")
    said = " ".join(stderr.split())
    assert code == 1 and "starts from the trials of study pre-tiny, which is neither in" in said and "run it first" in said, stderr
    database = tmp_path / "runs/studies/pre-tiny/optuna.db"
    database.parent.mkdir(parents=True)
    database.write_bytes(b"not a database" * 100)  # damaged: said as such, not as a study never run
    code, _, stderr = cli("study", "run", tune, "--out", tmp_path / "early")
    said = " ".join(stderr.split())
    assert code == 1 and "starts from the trials of study pre-tiny: " in said and "pre-tiny/optuna.db: file is not a database" in said, stderr
    database.unlink()
    code, _, stderr = cli("study", "run", pre)
    assert code in (0, None), stderr
    database = tmp_path / "runs/studies/pre-tiny/optuna.db"
    with sqlite3.connect(database) as db:  # yoco-u's trials as recorded before trials kept their folder
        db.execute("DELETE FROM trial_user_attributes WHERE key = 'run' AND trial_id IN"
                   " (SELECT trial_id FROM trial_user_attributes WHERE key = 'variant' AND value_json = '\"yoco-u\"')")
    code, _, stderr = cli("study", "run", study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 2]), "--out", tmp_path / "seedless")
    said = " ".join(stderr.split())
    assert code == 1 and "seed 2 starts from study pre-tiny's yoco trial of seed 2" in said and "completed seeds there: [0, 1]" in said, stderr

    code, stdout, stderr = cli("study", "run", study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1]), "--out", tmp_path / "tuned")
    assert code in (0, None), stderr
    pretrained = optuna.load_study(study_name="pre-tiny", storage=f"sqlite:///{database}").get_trials()
    finals = {}  # (variant, lr) -> final validation losses over the seeds
    for trial in pretrained:
        finals.setdefault((trial.user_attrs["variant"], trial.user_attrs["lr"]), []).append(trial.value)
    folders = {path.name.split("-", 1)[1]: path for path in (tmp_path / "runs/studies/pre-tiny/trials").glob("*/*")}
    runs = sorted((tmp_path / "tuned" / "trials").glob("*/*"))
    assert len(runs) == 4
    started = {}  # variant -> (its learning rate, the numbers of the trials its seeds started from)
    for run in runs:
        cfg = load_config(str(run / "config.yaml"))
        variant, seed = run.name.split("-", 1)[1].rsplit("-", 2)[:2]
        best = min((lr for v, lr in finals if v == variant), key=lambda lr: np.mean(finals[variant, lr]))
        slot = sorted(lr for v, lr in finals if v == variant).index(best)
        started_from = folders[f"{variant}-{seed}-lr{slot}"]
        assert cfg.init == str(started_from / "checkpoints/step-00000004"), run
        assert (run / "tokenizer.json").read_text() == (started_from.parents[2] / "tokenizer.json").read_text()
        assert cfg.data.cache is None and "eval_loss" in (run / "metrics.jsonl").read_text()
        started.setdefault(variant, (best, set()))[1].add(int(started_from.name.split("-", 1)[0]))
    for variant, (best, numbers) in started.items():  # the report says where each variant started
        assert (f"`{variant}` is fine-tuned from study `pre-tiny`'s `{variant}`: each seed from its trial of that seed at the learning rate"
                f" its report chose ({best:.2g}; trials {', '.join(str(n) for n in sorted(numbers))})") in stdout, stdout

    best, _ = started["yoco"]  # the pretraining study now scores yoco's other rate best: its trials would start elsewhere
    other = next(lr for v, lr in finals if v == "yoco" and lr != best)
    moved = {trial.number: trial for trial in pretrained if trial.user_attrs["variant"] == "yoco" and trial.user_attrs["lr"] == other}
    with sqlite3.connect(database) as db:
        db.executemany("UPDATE trial_values SET value = 0.5 WHERE trial_id = ?", [(t._trial_id,) for t in moved.values()])
    code, _, stderr = cli("study", "run", study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1]), "--out", tmp_path / "tuned")
    said = " ".join(stderr.split())
    assert code == 1 and "holds 2 trials that trained under another definition" in said and "Traceback" not in said, stderr
    old = {int(folder.name.split("-")[0]): folder.name for folder in folders.values()}
    for number, trial in moved.items():
        seed = trial.user_attrs["seed"]
        (was,) = [n for n in started["yoco"][1] if old[n].startswith(f"{n:04d}-yoco-s{seed}-")]
        assert (f"yoco seed {seed} lr slot 0: started from study pre-tiny's trial {was} (lr {best:g}), would now start from study"
                f" pre-tiny's trial {number} (lr {other:g})") in said, stderr
    assert "yoco-u seed" not in said

    # where trials start is looked up as a worker joins: the pretraining study choosing again while they run moves none of them
    study = load_study(str(study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1])))
    out = tmp_path / "pinned"
    url = storage_url(out, None)
    optuna_study = join(study, out, url, grace_period=60)  # yoco's seeds start from its trials at the other rate
    with sqlite3.connect(database) as db:  # which the pretraining study now scores as it did before: yoco's best rate is back
        db.executemany("UPDATE trial_values SET value = ? WHERE trial_id = ?", [(t.value, t._trial_id) for t in moved.values()])
    assert run_trial(study, optuna_study, claim(optuna_study, url, out), out, url)
    (first,) = optuna_study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    variant, seed, _ = planned_as(first)
    assert variant == "yoco" and first.user_attrs["started_from"]["trial"] in moved and first.user_attrs["started_from"]["lr"] == other
    assert load_config(f"{first.user_attrs['run']}/config.yaml").init == first.user_attrs["started_from"]["checkpoint"]
    with pytest.raises(StudyChanged, match=f"yoco seed {seed} lr slot 0: started from study pre-tiny's trial {first.user_attrs['started_from']['trial']}"):
        join(study, out, url, grace_period=60)

    # a start's weights changed on the disk are refused as a worker joins, not by each trial with a fine-tuning run's advice
    for weights in (tmp_path / "runs/studies/pre-tiny/trials").glob("*/*/checkpoints/*/model.safetensors"):
        weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    code, _, stderr = cli("study", "run", study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1]), "--out", tmp_path / "damaged")
    said = " ".join(stderr.split())
    assert code == 1 and re.search(r"variant yoco seed 0 starts from trial \d+ of pre-tiny: checkpoint \S+ is damaged \(its model.safetensors is"
                                   r" not the file saved with it: a hash of its bytes differs\); the trial's weights are its last checkpoint's:"
                                   r" put it back, or run that study afresh$", said), stderr
    assert not (tmp_path / "damaged" / "trials").exists()


def test_a_study_names_what_its_variants_cannot_start_from(cli, tmp_path):
    both = {"yoco": {"spec": "yoco.yaml"}, "yoco-u": {"spec": "yoco-u.yaml"}}
    study_file(tmp_path / "pre.yaml", {"yoco": {"spec": "yoco.yaml"}}, seeds=[0])
    cases = {
        "no-variant": ({**both, "yoco-u": {"spec": "yoco-u.yaml", "init": {"study": "pre.yaml"}}}, {},
                       "variants.yoco-u.init): study: study pre has no variant 'yoco-u'; it has ['yoco']"),
        "named": ({**both, "yoco-u": {"spec": "yoco-u.yaml", "init": {"study": "pre.yaml", "variant": "deeper"}}}, {},
                  "variants.yoco-u.init): variant: study pre has no variant 'deeper'"),
        "circle": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": "circle.yaml"}}}, {},
                   "starts from this study's trials, which start from it: a circle"),
        "unknown": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": "nothing-shipped"}}}, {},
                    "no file or shipped study of that name"),
        "both": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": "pre.yaml"}}}, {"init": str(tmp_path)},
                 f"variants.yoco.init: scales.tiny.train.init already starts every trial from {tmp_path}; give one or the other"),
        "run-and-study": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": "pre.yaml", "run": str(tmp_path)}}}, {},
                          "variants.yoco.init: give one of run (a training run every seed starts from) and study"),
        "neither": ({**both, "yoco": {"spec": "yoco.yaml", "init": {}}}, {}, "variants.yoco.init: give one of run"),
        "studyless": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"run": str(tmp_path), "variant": "yoco"}}}, {},
                      "variants.yoco.init.variant: names a variant of a study: give the study too, or drop it"),
        "no-run": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"run": str(tmp_path / "nowhere")}}}, {},
                   f"variants.yoco.init.run: {tmp_path / 'nowhere'} is not a training run with a checkpoint"),
        # empty names: a KeyError traceback, and a train.init of "" read as the current folder as each trial failed
        "empty-run": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"run": ""}}}, {},
                      "variants.yoco.init.run: is empty; give a training run's folder, or leave it out"),
        "empty-study": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": " "}}}, {},
                        "variants.yoco.init.study: is empty; give a study file or name, or leave it out"),
        "empty-variant": ({**both, "yoco": {"spec": "yoco.yaml", "init": {"study": "pre.yaml", "variant": ""}}}, {},
                          "variants.yoco.init.variant: is empty; give a variant's name, or leave it out"),
        "empty-init": (both, {"init": ""}, "init: is empty; give a path, or leave it out"),
    }
    for name, (variants, train, message) in cases.items():
        code, _, stderr = cli("study", "run", study_file(tmp_path / f"{name}.yaml", variants, seeds=[0], **train), "--out", tmp_path / name)
        said = " ".join(stderr.split())
        assert code == 1 and message in said and "Traceback" not in said, (name, stderr)
        assert not (tmp_path / name).exists() or name == "no-run", name  # refused as it loads (a run is looked for as it starts)


def test_a_study_refuses_a_start_whose_weights_its_variants_cannot_load(cli, pretrained, tmp_path):
    """Weights of another model, or changed on the disk, were found only as each trial failed on
    them, the damage with advice to give --init, which a study has not."""
    run = shutil.copytree(pretrained, tmp_path / "pretrained")
    latest, earlier = run / "checkpoints/step-00000004", run / "checkpoints/step-00000002"
    transformer, yoco = {"spec": "transformer.yaml"}, {"spec": "yoco.yaml"}
    cases = {
        "another-model": ({"transformer": transformer, "yoco": {**yoco, "init": {"run": str(run)}}}, {},
                          f"variants.yoco.init.run: checkpoint {latest} does not fit this model"),
        "every-variant": ({"transformer": transformer, "yoco": yoco}, {"init": str(run)},
                          f"scales.tiny.train.init: variant yoco: checkpoint {latest} does not fit this model"),
    }
    for name, (variants, train, message) in cases.items():
        code, _, stderr = cli("study", "run", study_file(tmp_path / f"{name}.yaml", variants, seeds=[0], baseline="transformer", **train),
                              "--out", tmp_path / name)
        said = " ".join(stderr.split())
        assert code == 1 and message in said and "Traceback" not in said, (name, stderr)
        assert not list((tmp_path / name).glob("trials/*/*")), name

    weights = bytearray((latest / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (latest / "model.safetensors").write_bytes(weights)
    path = study_file(tmp_path / "changed.yaml", {"transformer": transformer, "tuned": {**transformer, "init": {"run": str(run)}}},
                      seeds=[0], baseline="transformer")
    code, _, stderr = cli("study", "run", path, "--out", tmp_path / "changed")
    said = " ".join(stderr.split())
    assert code == 1 and (f"variants.tuned.init.run: checkpoint {latest} is damaged (its model.safetensors is not the file saved with"
                          f" it: a hash of its bytes differs); put it back as it was (the study's trials already trained started from"
                          f" it), or, in a study that has trained none from it, name the one before it, {earlier}") in said, stderr
    assert not list((tmp_path / "changed").glob("trials/*/*"))


def test_a_variants_run_is_recorded_as_the_path_it_names_from_where_the_study_runs(tmp_path, monkeypatch):
    """``init: {run: ...}`` is read from where the study runs, as runs/ is: each trial's setup
    records it made absolute, so that a worker started in another folder is compared by the run
    it would start from, not by the words naming it."""
    monkeypatch.chdir(tmp_path)
    path = study_file(tmp_path / "tune.yaml", {"yoco": {"spec": "yoco.yaml", "init": {"run": "runs/pre"}}}, seeds=[0])
    assert load_study(str(path)).setup("yoco", 0)["init"] == {"run": str(tmp_path / "runs" / "pre")}


def test_a_study_finds_the_study_it_starts_from_in_its_own_storage(cli, tmp_path):
    """Studies sharing a storage (a server, or one SQLite file) find each other there, whatever
    folders their trials trained in."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    pre = study_file(tmp_path / "pre.yaml", {"yoco": {"spec": "yoco.yaml"}}, seeds=[0])
    code, _, stderr = cli("study", "run", pre, "--storage", storage, "--out", tmp_path / "pretrained")
    assert code in (0, None), stderr
    tune = study_file(tmp_path / "tune.yaml", {"yoco": {"spec": "yoco.yaml", "init": {"study": "pre.yaml"}}}, seeds=[0])
    code, _, stderr = cli("study", "run", tune, "--storage", storage, "--out", tmp_path / "tuned")
    assert code in (0, None), stderr
    [started] = (tmp_path / "pretrained" / "trials").glob("*/0000-yoco-s0-lr0")
    [run] = (tmp_path / "tuned" / "trials").glob("*/*")
    assert load_config(str(run / "config.yaml")).init == str(started / "checkpoints/step-00000002")


def test_a_studys_variant_fine_tunes_from_a_run_beside_one_trained_afresh(cli, pretrained, tmp_path):
    """A variant's ``init: {run: ...}`` starts every seed from that run, reading text with its
    tokenizer; a variant without one trains from random weights on a corpus it tokenizes itself."""
    transformer, pretrained = {"spec": "transformer.yaml"}, shutil.copytree(pretrained, tmp_path / "pretrained")
    path = study_file(tmp_path / "tune.yaml", {"afresh": transformer, "tuned": {**transformer, "init": {"run": str(pretrained)}}},
                      seeds=[0, 1], baseline="afresh")
    code, stdout, stderr = cli("study", "run", path, "--out", tmp_path / "out")
    assert code in (0, None), stderr
    runs = {run.name.split("-", 1)[1]: run for run in (tmp_path / "out" / "trials").glob("*/*")}
    assert sorted(runs) == ["afresh-s0-lr0", "afresh-s1-lr0", "tuned-s0-lr0", "tuned-s1-lr0"]
    for name, run in runs.items():
        cfg = load_config(str(run / "config.yaml"))
        tuned = name.startswith("tuned")
        assert cfg.init == (str(pretrained / "checkpoints/step-00000004") if tuned else None), name
        assert ((run / "tokenizer.json").read_text() == (pretrained / "tokenizer.json").read_text()) or not tuned, name
    assert f"- `tuned` is fine-tuned from the run {pretrained} (step-00000004)\n" in stdout, stdout

    went_on = shutil.copytree(pretrained / "checkpoints/step-00000004", pretrained / "checkpoints/step-00000006")  # the run went on
    state = json.loads((went_on / "state.json").read_text())
    (went_on / "state.json").write_text(json.dumps({**state, "step": 6}))
    code, _, stderr = cli("study", "run", path, "--out", tmp_path / "out")
    said = " ".join(stderr.split())
    assert code == 1 and "holds 2 trials that trained under another definition" in said, stderr
    for seed in (0, 1):
        assert f"tuned seed {seed} lr slot 0: started from {pretrained} at step-00000004, would now start from {pretrained} at step-00000006" in said
    assert "put the definition back (and the studies or runs its variants start from), or run the study afresh" in said


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the storage's heartbeat options, as join opens it
def test_a_variant_given_a_start_after_it_trained_from_random_weights_is_refused(pretrained, tmp_path):
    """A setup records ``init`` only where set, and only recorded fields were compared: the trials
    trained from scratch were reported as fine-tuned."""
    transformer = {"spec": "transformer.yaml"}
    path = study_file(tmp_path / "tune.yaml", {"afresh": transformer, "tuned": transformer}, seeds=[0], baseline="afresh")
    out = tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(load_study(str(path)), out, url, grace_period=60)
    storage = optuna_study._storage
    for _ in ("afresh", "tuned"):  # trained as planned, in this order, recording their setups
        completed(load_study(str(path)), storage, claim(optuna_study, url, out), 2.0)
    tuned = load_study(str(study_file(path, {"afresh": transformer, "tuned": {**transformer, "init": {"run": str(pretrained)}}},
                                      seeds=[0], baseline="afresh")))
    with pytest.raises(StudyChanged, match=re.escape(f"tuned seed 0 lr slot 0: trained from random weights, would now start from"
                                                     f" {pretrained} at step-00000004")):
        join(tuned, out, url, grace_period=60)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_start_damaged_after_its_trials_finished_stops_only_trials_still_to_train(pretrained, tmp_path):
    """Each joining worker loaded every start's weights, so a start damaged after its trials were
    done blocked `study run` (and the report it prints) with nothing left to train from it."""
    from archlab.spec import SpecError

    run = shutil.copytree(pretrained, tmp_path / "pretrained")
    transformer = {"spec": "transformer.yaml"}
    cases = {"variant": ({"afresh": transformer, "tuned": {**transformer, "init": {"run": str(run)}}}, {}),
             "every": ({"afresh": transformer, "tuned": transformer}, {"init": str(run)})}
    for name, (variants, train) in cases.items():
        path = study_file(tmp_path / f"{name}.yaml", variants, seeds=[0], baseline="afresh", **train)
        out = tmp_path / name
        url = storage_url(out, None)
        optuna_study = join(load_study(str(path)), out, url, grace_period=60)
        for _ in variants:
            completed(load_study(str(path)), optuna_study._storage, claim(optuna_study, url, out), 2.0)
        weights = run / "checkpoints/step-00000004/model.safetensors"
        kept = weights.read_bytes()
        weights.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))
        join(load_study(str(path)), out, url, grace_period=60)  # nothing left to train: not refused

        more = load_study(str(study_file(path, variants, seeds=[0, 1], baseline="afresh", **train)))  # a seed added: trials to train
        with pytest.raises(SpecError, match="is damaged"):
            join(more, out, url, grace_period=60)
        weights.write_bytes(kept)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_scales_start_is_pinned_to_its_checkpoint_as_a_variants_is(pretrained, tmp_path):
    """A scale's train.init was resolved by each trial as it started: a seed added after the run
    gained a checkpoint trained from the newer one beside trials from the older, and no trial
    recorded where it started. A run trained again in place, its checkpoint of the same name, is
    told apart by its weights' hash."""
    run = shutil.copytree(pretrained, tmp_path / "pretrained")
    transformer = {"spec": "transformer.yaml"}
    variants = {"afresh": transformer, "tuned": transformer}
    path = study_file(tmp_path / "every.yaml", variants, seeds=[0], baseline="afresh", init=str(run))
    out = tmp_path / "out"
    url = storage_url(out, None)
    optuna_study = join(load_study(str(path)), out, url, grace_period=60)
    starts = optuna_study.user_attrs["starts"]
    assert {variant: starts[variant]["0"]["checkpoint"] for variant in starts} == dict.fromkeys(variants, str(run / "checkpoints/step-00000004"))
    for _ in variants:  # trained as a worker trains them, recording where they started
        trial_id = claim(optuna_study, url, out)
        variant = planned_as(optuna_study._storage.get_trial(trial_id))[0]
        optuna_study._storage.set_trial_user_attr(trial_id, "started_from", starts[variant]["0"])
        completed(load_study(str(path)), optuna_study._storage, trial_id, 2.0)
    assert starts_said(load_study(str(path)), optuna_study.get_trials()) == [
        f"- `{variant}` is fine-tuned from the run {run} (step-00000004)" for variant in variants]  # no line at all before

    more = load_study(str(study_file(path, variants, seeds=[0, 1], baseline="afresh", init=str(run))))
    latest = run / "checkpoints/step-00000004"
    kept = (latest / "model.safetensors").read_bytes(), (latest / "state.json").read_text()
    (latest / "model.safetensors").write_bytes(kept[0][:-1] + bytes([kept[0][-1] ^ 1]))  # the run trained again in place
    (latest / "state.json").write_text(json.dumps({**json.loads(kept[1]), "weights_blake2b": file_hash(latest / "model.safetensors")}))
    with pytest.raises(StudyChanged, match=re.escape(f"afresh seed 0 lr slot 0: started from {run} at step-00000004, whose weights have"
                                                     " changed since")):
        join(more, out, url, grace_period=60)
    (latest / "model.safetensors").write_bytes(kept[0])
    (latest / "state.json").write_text(kept[1])

    went_on = shutil.copytree(latest, run / "checkpoints/step-00000006")  # the run went on
    (went_on / "state.json").write_text(json.dumps({**json.loads((went_on / "state.json").read_text()), "step": 6}))
    with pytest.raises(StudyChanged, match=re.escape(f"afresh seed 0 lr slot 0: started from {run} at step-00000004, would now start"
                                                     f" from {run} at step-00000006")):
        join(more, out, url, grace_period=60)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_worker_on_another_definition_keeps_the_starts_of_the_variants_it_does_not_plan(pretrained, tmp_path):
    """A joining worker wrote the starts of its own variants over all of them: the first worker's
    fine-tuned trials then failed, finding no start."""
    transformer = {"spec": "transformer.yaml"}
    tuned = {"afresh": transformer, "tuned": {**transformer, "init": {"run": str(pretrained)}}}
    first = load_study(str(study_file(tmp_path / "tune.yaml", tuned, seeds=[0, 1], baseline="afresh")))
    out = tmp_path / "out"
    url = storage_url(out, None)
    join(first, out, url, grace_period=60)
    second = load_study(str(study_file(tmp_path / "tune.yaml", {**tuned, "afresh": transformer}, seeds=[0], baseline="afresh")))
    join(second, out, url, grace_period=60)
    narrower = load_study(str(study_file(tmp_path / "tune.yaml", {"afresh": transformer}, seeds=[0], baseline="afresh")))
    starts = join(narrower, out, url, grace_period=60).user_attrs["starts"]
    assert sorted(starts) == ["tuned"] and sorted(starts["tuned"]) == ["0", "1"]
    assert starts["tuned"]["1"]["checkpoint"] == str(pretrained / "checkpoints/step-00000004")


def test_chat_says_a_run_fine_tuned_on_pairs_learned_no_turns(cli, pretrained, examples, tmp_path, monkeypatch):
    """Its replies end at a newline, after a bare prompt; chat gives it role headers and turns."""
    run = tmp_path / "pairs"
    code, _, stderr = cli("train", "specs/tiny/transformer.yaml", "--out", run, "--init", pretrained, "--data", examples,
                          "--steps", "1", *SMALL)
    assert code == 0, stderr
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, _, stderr = cli("chat", run, "--max-new-tokens", "1")
    assert code in (0, None) and (f"{run} trained on the prompt/response pairs of {examples}, not on conversations: it learned a"
                                  " response after a bare prompt, ended by a newline") in " ".join(stderr.split()), stderr


def test_chat_names_a_damaged_config_of_its_run(cli, pretrained, tmp_path, monkeypatch):
    """Chat reads the run's config.yaml for its data source after the weights loaded; a damaged
    one was a SpecError traceback there, where every other command reading it names the file."""
    run = tmp_path / "run"
    shutil.copytree(pretrained, run)
    (run / "config.yaml").write_text("")
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi.\n"))
    code, stdout, stderr = cli("chat", run, "--max-new-tokens", 2)
    assert code == 1 and f"error in {run / 'config.yaml'}" in stderr and "the file is empty" in stderr, stderr
    assert stdout == ""  # refused before the conversation began


def test_examples_whose_responses_are_all_empty_are_said_to_teach_only_an_end(tmp_path):
    """Trained with exit 0 and an accuracy of 100%: only the newline ending each response counted."""
    pairs, chats = tmp_path / "pairs.jsonl", tmp_path / "chats.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"question {i}", "response": ""}) + "\n" for i in range(3)))
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": " "}]}) + "\n"
                             for i in range(3)))
    for path in (pairs, chats):
        with pytest.warns(UserWarning, match="every response \\(or assistant message\\) is empty; a run on it learns only to end a reply"):
            read_examples(str(path), 10_000)
    pairs.write_text(pairs.read_text() + json.dumps({"prompt": "q", "response": "an answer"}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_examples(str(pairs), 10_000)) == 4

