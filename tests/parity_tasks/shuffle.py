"""process_docs for shuffled_facts.yaml: the choices in an order drawn from Python's global random state."""

import random


def shuffle_choices(dataset):
    def shuffle(doc):
        choices = list(doc["choices"])
        right = choices[doc["answer"]]
        random.shuffle(choices)
        return {**doc, "choices": choices, "answer": choices.index(right)}

    return dataset.map(shuffle, load_from_cache_file=False)  # a cached map would hide the random state
