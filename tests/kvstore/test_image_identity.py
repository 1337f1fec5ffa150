"""Images in the block identity (docs/design.md section 3): a block's key covers every image whose placeholders
fall in or before it, and a hit never ends where a block holds too little of an image to tell it apart."""

from __future__ import annotations

import os

import pytest

from kvstore.block import (
    IMAGE_ID_BASE,
    IMAGE_SURE_PLACEHOLDERS,
    ImageSpan,
    KVLayout,
    Namespace,
    identity_tokens,
    image_identity_ids,
    image_safe_prefix,
)

B = 16
SPACE = Namespace("m", KVLayout(2, 1, 8), B)
PLACEHOLDER = 7  # the id the prompt holds at an image's placeholders; identity never uses it


def _prompt(length: int, image_at: int, image_len: int) -> list[int]:
    tokens = [(i * 31 + 5) % 500 for i in range(length)]
    tokens[image_at : image_at + image_len] = [PLACEHOLDER] * image_len
    return tokens


def _shared(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x.key != y.key), len(a))


@pytest.mark.parametrize("image_at", [0, 1, 15, 16, 17, 40, 47])
def test_prompts_alike_but_for_one_image_share_exactly_the_blocks_before_it(image_at):
    tokens = _prompt(128, image_at, 20)
    one, other = ImageSpan(image_at, 20, os.urandom(16)), ImageSpan(image_at, 20, os.urandom(16))
    a = SPACE.blocks(identity_tokens(tokens, [one]))
    b = SPACE.blocks(identity_tokens(tokens, [other]))
    assert _shared(a, b) == image_at // B  # every block from the image's on differs, the ones before are shared
    assert SPACE.blocks(identity_tokens(tokens, [one])) == a  # the same image hits: keys are a pure function


def test_the_same_image_at_another_position_does_not_hit():
    digest = os.urandom(16)
    tokens = _prompt(128, 40, 20)
    here = SPACE.blocks(identity_tokens(tokens, [ImageSpan(40, 20, digest)]))
    moved = [9] + tokens[:-1]  # one token more before it: the image at 41
    there = SPACE.blocks(identity_tokens(moved, [ImageSpan(41, 20, digest)]))
    assert _shared(here, there) == 0
    later = tokens[:40] + [9] + tokens[40:-1]  # the same text before it, then one token, then the image at 41
    there = SPACE.blocks(identity_tokens(later, [ImageSpan(41, 20, digest)]))
    assert _shared(here, there) == 40 // B  # only the blocks before the image's first


def test_two_images_count_in_order():
    tokens = _prompt(128, 10, 20)
    tokens[50:70] = [PLACEHOLDER] * 20
    first, second = os.urandom(16), os.urandom(16)
    ab = SPACE.blocks(identity_tokens(tokens, [ImageSpan(10, 20, first), ImageSpan(50, 20, second)]))
    ba = SPACE.blocks(identity_tokens(tokens, [ImageSpan(10, 20, second), ImageSpan(50, 20, first)]))
    assert _shared(ab, ba) == 0
    other_second = SPACE.blocks(identity_tokens(tokens, [ImageSpan(10, 20, first), ImageSpan(50, 20, os.urandom(16))]))
    assert _shared(ab, other_second) == 50 // B


def test_identity_ids_golden_vector():
    """Fixed digest -> fixed ids: a change of their encoding (the index's width, the bits kept) changes the key
    of every block after an image, so it must break this test first."""
    assert image_identity_ids(bytes(range(16)), 6) == [3988192332, 4130470044, 3806668920, 3687329338, 3154305559,
                                                       3655378245]


def test_identity_ids_lie_above_every_vocabulary_and_carry_the_digest():
    digest = os.urandom(16)
    ids = image_identity_ids(digest, 64)
    assert all(IMAGE_ID_BASE <= i < 2 * IMAGE_ID_BASE for i in ids)
    assert len(set(ids)) == 64  # positions within the image differ
    assert image_identity_ids(digest, 64) == ids and image_identity_ids(os.urandom(16), 64) != ids
    tokens = _prompt(40, 8, 20)
    keyed = identity_tokens(tokens, [ImageSpan(8, 20, digest)])
    assert keyed[:8] == tokens[:8] and keyed[28:] == tokens[28:] and keyed[8:28] == image_identity_ids(digest, 20)
    # a leading part of the prompt (a decode engine saving the blocks it filled) cuts the image, same ids
    assert identity_tokens(tokens[:16], [ImageSpan(8, 20, digest)]) == keyed[:16]


def test_a_hit_never_ends_in_a_block_with_too_little_of_an_image():
    span = ImageSpan(46, 20, os.urandom(16))  # placeholders 0-1 in block 2, the 5th in block 3
    assert (46 + IMAGE_SURE_PLACEHOLDERS - 1) // B == 3
    assert image_safe_prefix(2, [span], B) == 2  # ends before the image
    assert image_safe_prefix(3, [span], B) == 2  # block 2 holds 2 placeholders (62 bits): cut back before it
    assert image_safe_prefix(4, [span], B) == 4  # block 3 holds the 5th: the key carries the whole image
    assert image_safe_prefix(3, [ImageSpan(32, 20, span.digest)], B) == 3  # block 2 holds 16 of its placeholders
    # block 2 holds exactly IMAGE_SURE_PLACEHOLDERS of it (43-47): enough, the hit is not cut; one fewer is cut
    assert image_safe_prefix(3, [ImageSpan(B * 3 - IMAGE_SURE_PLACEHOLDERS, 20, span.digest)], B) == 3
    assert image_safe_prefix(3, [ImageSpan(B * 3 - IMAGE_SURE_PLACEHOLDERS + 1, 20, span.digest)], B) == 2



def test_with_two_images_a_hit_never_ends_in_a_block_with_too_little_of_the_second():
    first = ImageSpan(0, 20, os.urandom(16))  # whole in blocks 0 and 1
    second = ImageSpan(46, 20, os.urandom(16))  # placeholders 0-1 in block 2, the 5th in block 3
    assert image_safe_prefix(3, [first, second], B) == 2, "block 2 holds 62 bits of the second image"
    assert image_safe_prefix(4, [first, second], B) == 4
    assert image_safe_prefix(1, [ImageSpan(14, 20, first.digest), second], B) == 0  # the first's rule still holds

def test_bad_images_are_refused():
    ImageSpan(0, IMAGE_SURE_PLACEHOLDERS, bytes(16))  # the fewest placeholders an image may have
    with pytest.raises(ValueError, match="at least 5 placeholders"):
        ImageSpan(0, 4, bytes(16))
    with pytest.raises(ValueError, match="16 bytes"):
        ImageSpan(0, 8, bytes(8))
    with pytest.raises(ValueError, match="overlaps"):
        identity_tokens(list(range(64)), [ImageSpan(0, 10, bytes(16)), ImageSpan(5, 10, bytes(16))])
