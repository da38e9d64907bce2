"""The words of the built-in word problems, kept below the tokenizer that is trained on them.

:mod:`offline_plugins.text.tasks.word_problems` makes its problems from these sentences, and
:func:`offline_plugins.modules.small_lm.task_corpus` trains the ``small`` tokenizer on problems
made from them, so the words a task uses are the words the tokenizer merged (this layer cannot
import the environments). A sentence is a ``str.format`` template over ``{name}`` (a person),
``{P}``/``{p}`` (the pronoun, capitalised or not), ``{o}`` (its object form), ``{item}`` (a
plural noun) and ``{b}`` (the step's number).

>>> OPERATIONS["add"][0].format(P="She", b=7, item="apples")
'She buys 7 more apples.'
>>> sorted(OPERATIONS)
['add', 'div', 'mul', 'sub']
"""

from __future__ import annotations

__all__ = ["PEOPLE", "ITEMS", "OPENINGS", "OPERATIONS", "QUESTIONS", "FRIENDS"]

#: people and their pronouns (subject, object)
PEOPLE: tuple[tuple[str, str, str], ...] = (
    ("Mia", "she", "her"), ("Leo", "he", "him"), ("Ava", "she", "her"), ("Sam", "he", "him"),
    ("Zoe", "she", "her"), ("Max", "he", "him"), ("Lily", "she", "her"), ("Noah", "he", "him"),
    ("Emma", "she", "her"), ("Omar", "he", "him"), ("Nina", "she", "her"), ("Ravi", "he", "him"),
)

#: the people who give and take
FRIENDS: tuple[str, ...] = ("a friend", "the teacher", "a neighbour", "a classmate", "the baker", "an uncle")

#: what is counted (plural nouns)
ITEMS: tuple[str, ...] = ("apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cookies",
                          "stamps", "cards", "eggs", "flowers")

#: the first sentence: the starting quantity ``{b}``
OPENINGS: tuple[str, ...] = (
    "{name} has {b} {item}.",
    "{name} starts the day with {b} {item}.",
    "There are {b} {item} in {name}'s box.",
)

#: one sentence per reasoning step, by operation on the running quantity
OPERATIONS: dict[str, tuple[str, ...]] = {
    "add": ("{P} buys {b} more {item}.", "{friend} gives {o} {b} {item}.", "{P} finds {b} more {item}."),
    "sub": ("{P} gives {b} {item} to {friend}.", "{P} loses {b} {item}.", "{P} sells {b} of the {item}."),
    "mul": ("Then {p} has {b} times as many {item} as before.", "{P} trades them and gets {b} times as many."),
    "div": ("{P} puts the {item} into {b} equal bags and keeps one bag.",
            "{P} shares the {item} equally among {b} children and keeps one share."),
}

#: the question after the steps
QUESTIONS: tuple[str, ...] = ("How many {item} does {name} have now?", "How many {item} are left in the end?")
