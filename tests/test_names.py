"""Messages cut for a terminal line: at a sentence or field boundary, never mid-word."""

from pytest_freezecompat.core.names import clip, headline

DDP = ("Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
       "that your module has parameters that were not used in producing loss. You can enable unused parameter "
       "detection by passing the keyword argument `find_unused_parameters=True` to "
       "`torch.nn.parallel.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs participate "
       "in calculating loss. \nIf you already have done the above, then the distributed data parallel module wasn't "
       "able to locate the output tensors in the return value of your module's `forward` function. Please include "
       "the loss function and the structure of the return value of `forward` of your module when reporting this "
       "issue (e.g. list, dict, iterable).")


def test_headline_joins_a_wrapped_paragraph_and_ends_at_a_sentence():
    line = headline(DDP)
    assert "\n" not in line and "and by making sure all `forward` function outputs" in line
    assert line.endswith("calculating loss. …") and len(line) <= 500


def test_clip_prefers_a_sentence_then_a_field_then_a_word():
    assert clip("short", 10) == "short"
    assert clip("One two three four. Five six seven eight nine", 30) == "One two three four. …"
    assert clip("alpha beta gamma delta; epsilon zeta eta theta", 30) == "alpha beta gamma delta …"
    assert clip("One. Two three four five six seven eight nine", 30) == "One. Two three four five …"  # too early
    assert clip("alphabet soup with many words in it", 20) == "alphabet soup …"
    assert clip("a" * 40, 20) == "a" * 18 + "…"  # one token filling the room: nothing better to cut at


def test_headline_keeps_only_the_first_paragraph():
    assert headline("first line\ncontinues\n\nsecond paragraph") == "first line continues"
