"""The prompt sets of self-distillation and of the acceptance benchmark: generated, nothing downloaded.

An instruction is a template filled with a topic (``"Explain {t} to a ten-year-old."`` x ``"volcanoes"``).
The topics are split: :data:`TRAIN_TOPICS` feed ``train-drafter``, :data:`HELD_OUT_TOPICS` only ``bench
acceptance``, so acceptance is measured on prompts whose subject the drafter never saw. A checkpoint
directory with a chat template gets each instruction as one user turn with the generation prompt, one whose
tokenizer has no template (a base model) the instruction's text; one without a tokenizer (the tiny test models)
gets seeded random token ids instead.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from tensorrt_llm_ext.logger import logger

TEMPLATES = (
    "Explain {t} to a ten-year-old.", "Write a short story about {t}.", "List five facts about {t}.",
    "What are the pros and cons of {t}?", "Write a haiku about {t}.", "Give me three tips related to {t}.",
    "Summarize the history of {t} in a paragraph.", "Write a short poem about {t}.",
    "What is the most common misconception about {t}?", "Describe {t} in simple terms.",
    "Write a friendly email to a colleague about {t}.", "How would you teach {t} to a beginner?",
    "Compare {t} with something from everyday life.", "Write a product description inspired by {t}.",
    "What questions should I ask an expert on {t}?", "Write a dialogue between two friends discussing {t}.",
    "Why is {t} important?", "Give a step-by-step guide to learning about {t}.",
    "Write a tweet about {t}.", "What would the world look like without {t}?",
)
TRAIN_TOPICS = (
    "volcanoes", "photosynthesis", "the moon", "bread baking", "electric cars", "honeybees", "the Roman Empire",
    "recycling", "chess", "rainbows", "the internet", "coffee", "dinosaurs", "sleep", "gardening", "music theory",
    "black holes", "vaccines", "the ocean", "bicycles", "friendship", "budgeting", "climate change", "robots",
    "ancient Egypt", "mountains", "python programming", "healthy breakfast", "time management", "whales",
    "the solar system", "libraries", "earthquakes", "democracy", "painting", "rivers", "airplanes", "cats",
    "dogs", "the human heart", "renewable energy", "fairy tales", "football", "deserts", "magnets", "pizza",
    "the printing press", "forests", "penguins", "trains", "math puzzles", "weather forecasts", "castles",
    "the immune system", "volunteering", "smartphones", "camping", "origami", "tea", "birds",
)
HELD_OUT_TOPICS = (
    "glaciers", "submarines", "the Olympic Games", "mushrooms", "lighthouses", "jazz", "bridges", "octopuses",
    "the periodic table", "kites", "public speaking", "snow", "pyramids", "video games", "the alphabet", "owls",
)


def instructions(split: str, n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instructions of ``split`` (``"train"`` or ``"held_out"``), shuffled by ``seed``."""
    if split not in ("train", "held_out"):
        raise ValueError(f"prompt split must be 'train' or 'held_out', got {split!r}")
    topics = TRAIN_TOPICS if split == "train" else HELD_OUT_TOPICS
    pool = [tpl.format(t=topic) for topic in topics for tpl in TEMPLATES]
    random.Random(seed).shuffle(pool)
    if n > len(pool):
        raise ValueError(f"{split} prompts: {n} asked, {len(pool)} distinct ones exist (sample several "
                         "continuations per prompt instead)")
    return pool[:n]


def prompt_token_ids(model_dir: str | Path | None, split: str, n: int, vocab_size: int, seed: int = 0,
                     random_len: tuple[int, int] = (4, 12)) -> list[list[int]]:
    """Token ids of ``n`` prompts for ``model_dir``: chat-templated instructions when its tokenizer has a chat
    template, else seeded random ids (length in ``random_len``; logged once)."""
    found = prompt_tokenizer(model_dir)
    if found is not None:
        tokenizer, chat = found
        return [encode_conversation(tokenizer, chat, [{"role": "user", "content": text}])
                for text in instructions(split, n, seed)]
    logger.info(f"prompts: {model_dir or 'the embedded model'} has no tokenizer; {n} random {split} prompts "
                f"(seed {seed})")
    rng = random.Random(f"{split}-{seed}")
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*random_len))] for _ in range(n)]


@functools.lru_cache(maxsize=4)  # one load per run: the train and held-out splits share it
def prompt_tokenizer(model_dir):
    """``(tokenizer, has_chat_template)`` of the checkpoint in ``model_dir``, or None without a tokenizer. A base
    model (a tokenizer, no chat template) gets its prompts as plain text (:func:`encode_conversation`), logged
    once: it was given seeded random ids, as a model without a tokenizer is, until 2026-12-05."""
    if model_dir is None:
        return None
    from tensorrt_llm_ext.models.checkpoint import read_checkpoint_facts

    facts = read_checkpoint_facts(model_dir)
    if not facts.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    if not facts.has_chat_template:
        logger.info(f"prompts: {model_dir}'s tokenizer has no chat template: each conversation is its turns' text, "
                    "one blank line apart, as a base model reads it")
    return AutoTokenizer.from_pretrained(str(model_dir)), facts.has_chat_template


PLAIN_TURN_SEPARATOR = "\n\n"


def plain_text(messages: list[dict]) -> str:
    """A conversation for a tokenizer without a chat template: its turns' text, one blank line apart."""
    return PLAIN_TURN_SEPARATOR.join(str(m["content"]) for m in messages)


def encode_conversation(tokenizer, chat: bool, messages: list[dict]) -> list[int]:
    """Token ids of ``messages``: the chat template with the generation prompt, or (``chat`` False) the plain text
    with the tokenizer's own special tokens (a BOS where it adds one)."""
    if chat:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(plain_text(messages))["input_ids"])
