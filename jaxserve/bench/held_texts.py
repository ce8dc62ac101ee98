"""Held-out texts for ``jaxserve bench accuracy``: short passages written for this repository
(prose, a recipe, a dialogue, code, numbers), so that every weight format is scored on the same
tokens, and perplexity is measured on a text the repo ships."""

HELD_TEXTS: tuple[str, ...] = (
    "The old lighthouse stood at the end of a narrow stone pier. Every evening the keeper climbed "
    "its spiral stairs, trimmed the wick and polished the great lens until it shone. Ships passing "
    "in the dark saw the beam sweep across the water and knew the rocks were near. When the light "
    "was finally replaced by an automatic lamp, the keeper moved into a cottage in the village, but "
    "he still walked to the pier each night to watch the beam turn.",
    "To make a simple tomato soup, soften a chopped onion and two cloves of garlic in olive oil. "
    "Add a kilogram of ripe tomatoes, a pinch of salt and half a litre of vegetable stock. Let it "
    "simmer for twenty minutes, then blend until smooth. Taste it, add pepper and a little sugar if "
    "the tomatoes are sharp, and serve it hot with bread.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high "
    "mountains, because the air pressure there is lower. This is why cooking pasta takes longer in "
    "the Alps than on the coast. A pressure cooker works the other way round: it raises the "
    "pressure inside the pot, so the water boils hotter and food cooks faster.",
    "User: Can you recommend a good way to learn a new language?\nAssistant: Practise a little "
    "every day rather than a lot once a week. Start with the most common words and phrases, listen "
    "to native speakers as often as you can, and do not be afraid of making mistakes when you speak. "
    "Reading simple stories and keeping a small notebook of new words also helps.",
    "def mean(values):\n    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"\n"
    "    if not values:\n        raise ValueError(\"values must not be empty\")\n"
    "    return sum(values) / len(values)\n\n\nprint(mean([2, 4, 6, 8]))\n",
    "The train left the station at nine in the morning and travelled north through farmland and "
    "small towns. By noon it had crossed the river, and by three in the afternoon the first hills "
    "appeared on the horizon. The passengers in the last carriage opened the windows to feel the "
    "cooler air, and a child pointed at the snow still lying on the highest peaks.",
)
