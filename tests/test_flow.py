"""The flow board between the llm model and postprocessing: marks, holding and lost chunks."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tritone.scheduling.request import FinishReason, RequestOutput
from tritone.serving.flow import EVIDENCE_AGE_S, LOST_AFTER_S, NUM_SLOTS, ChunkWatch, FlowBoard, new_key, remove_stale
from tritone.serving.inputs import parse_llm_request
from tritone.serving.processing import Postprocessor
from tritone.serving.responses import ResponseState, ResponseStream
from tritone.text import Detokenizer

MS = 1_000_000


@pytest.fixture
def boards(tmp_path):
    """The llm model's board and a postprocessing instance's: one page, two mappings."""
    llm, post = FlowBoard(tmp_path / "flow"), FlowBoard(tmp_path / "flow")
    llm.reset()
    post.claim_cell()
    yield llm, post
    llm.close()
    post.close()


def _live(llm, slot, sent=1 << 40):
    """A stream of the llm model's on the board, whose chunks up to send number `sent` went out."""
    key = new_key(slot)
    llm.register(key)
    llm.sending(key, sent)
    return key


def test_marks_cross_mappings_and_a_released_slot_takes_none(boards):
    llm, post = boards
    key = _live(llm, 5)
    assert not llm.is_received(key, 1)
    post.received([(key, 1, 0)])
    assert llm.is_received(key, 1) and not llm.is_received(key, 2)
    llm.release(key)
    post.received([(key, 2, 1)])  # late, after the stream ended
    later = _live(llm, 5)  # the next stream in the slot starts with no marks
    assert not llm.is_received(later, 1) and not llm.is_received(key, 2)


def test_a_forged_state_marks_nothing_and_makes_no_chunk_look_lost(boards):
    """Postprocessing is public: a STATE made up by a client names keys it cannot know."""
    llm, post = boards
    key = _live(llm, 7, sent=3)
    watch = ChunkWatch(key=key, seq=1, sent=3, sent_at_ns=0)
    forged = [(key ^ (1 << 20), 1, 10**12), (7, 1, 10**12), (0, 1, 10**12), (-1, 1, 10**12)]
    post.received(forged)
    assert not llm.is_received(key, 1)
    assert llm.evidence(0).last_sent_received == -1
    # A real key with a send number beyond its stream's last send claims no more than that send.
    post.received([(key, 1, 10**12)])
    assert llm.evidence(0).last_sent_received == 3 and not watch.is_lost(llm, llm.evidence(10**12))


def test_reset_forgets_a_previous_servers_marks_and_gone_instances(boards, tmp_path):
    llm, post = boards
    key = _live(llm, 3)
    post.received([(key, 7, 0)])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    llm.cells[5, 0] = int(gone.stdout)
    llm.reset()
    assert not llm.is_received(key, 1)
    assert llm.cells[5, 0] == 0 and post.cells[post.cell, 0] != 0


def test_pages_of_gone_servers_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for pid in (int(gone.stdout), os.getpid()):
        FlowBoard(tmp_path / f"tritone-flow-{pid}").close()
        (tmp_path / f"tritone-{pid}-abc").mkdir()
        FlowBoard(tmp_path / f"tritone-{pid}-abc" / "board").close()
    assert remove_stale(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tritone-{os.getpid()}-abc", f"tritone-flow-{os.getpid()}"]


def test_a_board_that_is_a_link_or_readable_by_others_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "board").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        FlowBoard(tmp_path / "board")
    (tmp_path / "open").write_bytes(b"")
    (tmp_path / "open").chmod(0o644)
    with pytest.raises(RuntimeError, match="not a private file"):
        FlowBoard(tmp_path / "open")


def test_a_chunk_is_lost_once_a_later_one_arrived_and_the_evidence_aged(boards):
    llm, post = boards
    one, two = _live(llm, 1), _live(llm, 2)
    watch = ChunkWatch(key=one, seq=1, sent=10, sent_at_ns=0)
    post.received([(two, 1, 11)])  # another stream's later chunk
    post.done()
    t = int(LOST_AFTER_S * 1e9)
    assert not watch.is_lost(llm, _busy(llm.evidence(t)))  # suspected only
    assert watch.is_lost(llm, _busy(llm.evidence(t + int(EVIDENCE_AGE_S * 1e9))))


def test_a_chunk_marked_late_is_not_lost(boards):
    llm, post = boards
    one, two = _live(llm, 1), _live(llm, 2)
    watch = ChunkWatch(key=one, seq=1, sent=10, sent_at_ns=0)
    post.received([(two, 1, 11)])
    t = int(LOST_AFTER_S * 1e9)
    assert not watch.is_lost(llm, llm.evidence(t))
    post.received([(one, 1, 10)])  # its instance had not marked it yet
    assert not watch.is_lost(llm, llm.evidence(t + 10 * int(EVIDENCE_AGE_S * 1e9)))


def test_an_instance_idle_since_the_send_means_the_chunk_was_refused(boards):
    llm, post = boards
    post.received([])
    post.done()
    idle_since = int(post.cells[post.cell, 2])
    watch = ChunkWatch(key=_live(llm, 1), seq=1, sent=0, sent_at_ns=idle_since + 1)
    assert not watch.is_lost(llm, llm.evidence(idle_since + 50 * MS))  # too soon to tell
    now = idle_since + int(LOST_AFTER_S * 1e9)
    assert not watch.is_lost(llm, llm.evidence(now))
    assert watch.is_lost(llm, llm.evidence(now + int(EVIDENCE_AGE_S * 1e9)))


def test_nothing_is_lost_while_every_instance_is_busy_and_nothing_later_arrived(boards):
    llm, post = boards
    one, two = _live(llm, 1), _live(llm, 2)
    post.received([(two, 1, 5)])  # busy with an earlier chunk
    watch = ChunkWatch(key=one, seq=1, sent=10, sent_at_ns=0)
    for seconds in (0.3, 1.0, 10.0):
        assert not watch.is_lost(llm, llm.evidence(int(seconds * 1e9)))


def _busy(evidence):
    return type(evidence)(evidence.at_ns, evidence.last_sent_received, 0)


# ---- the llm model's streams on the board

def _output(ids, n_out, finished=False):
    return RequestOutput("r", list(ids), [0.0] * len(ids), 2, n_out, finished,
                       FinishReason.LENGTH if finished else None)


def test_a_stream_holds_tokens_while_its_chunk_is_on_the_way(boards, tokenizer):
    llm, post = boards
    detok = Detokenizer(tokenizer)
    ids = tokenizer("The capital of France is Paris, a city of light.", add_special_tokens=False).input_ids
    req = parse_llm_request(lambda n: {"INPUT_IDS": np.array([1, 2]), "MAX_TOKENS": np.array([len(ids)]),
                                       "STREAM": np.array([True]), "CONTROL_KEY": np.array([b""], dtype=object)}.get(n))
    assert req.flow_control
    stream = ResponseStream(req, detok, key=_live(llm, 9), flow=llm)
    postprocess, chunks, texts = Postprocessor(detok, post), [], []
    for i, token in enumerate(ids):
        tensors = stream.on_output(_output([token], i + 1, finished=i == len(ids) - 1))
        if tensors is not None:
            chunks.append(tensors)
        if i % 3 == 2 or i == len(ids) - 1:  # postprocessing takes what waits every third step
            texts += [postprocess([c.get])[0]["TEXT_OUTPUT"][0].decode() for c in chunks[len(texts):]]
    sizes = [len(c["TOKEN_IDS"]) for c in chunks]
    # Each chunk waited for the last to arrive; the tokens in between went together.
    assert sizes[0] == 1 and max(sizes) > 1 and sum(sizes) == len(ids) and len(sizes) < len(ids)
    assert "".join(texts) == tokenizer.decode(ids)
    assert stream.is_finished and stream.in_flight is None


def test_the_final_chunk_never_waits(boards, tokenizer):
    llm, _ = boards
    req = parse_llm_request(lambda n: {"INPUT_IDS": np.array([1]), "MAX_TOKENS": np.array([3]),
                                       "STREAM": np.array([True]), "CONTROL_KEY": np.array([b""], dtype=object)}.get(n))
    stream = ResponseStream(req, Detokenizer(tokenizer), key=_live(llm, 4), flow=llm)
    assert stream.on_output(_output([10], 1)) is not None
    assert stream.on_output(_output([11], 2)) is None  # held: chunk 1 not received
    final = stream.on_output(_output([12], 3, finished=True))
    assert final["TOKEN_IDS"].tolist() == [11, 12] and ResponseState.read(final["STATE"]).is_final
