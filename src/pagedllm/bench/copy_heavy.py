"""The `copy-heavy` benchmark dataset: prompts that ask the model to repeat, edit or reformat text or code given in
the prompt, where most output tokens are already in the context (the case prompt-lookup and suffix speculative
decoding are for). Built in, no download: PASSAGES x TASKS, wrapped in the chat template."""

from __future__ import annotations

import random

from pagedllm.bench.datasets import SampleRequest

TASKS = (
    "Repeat the following text exactly, word for word, with nothing before or after it.",
    "Copy the following code exactly, then stop.",
    "Rewrite the following, keeping every line but putting it in a Markdown code block.",
    "Fix the spelling mistakes in the following text and return the whole corrected text.",
    "Return the following content unchanged, preceded by the line 'Result:'.",
)

PASSAGES = (
    """def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)""",
    """The library opens at nine in the morning on weekdays and at ten on weekends. Visitors can borrow up to
five books at a time for three weeks. Books that are returned late cost ten cents per day. The reading room on the
second floor is reserved for quiet study, and the children's section on the ground floor hosts a story hour every
Saturday at eleven. Wireless internet is free for everyone with a library card.""",
    """{
  "name": "weather-station",
  "version": "1.4.2",
  "sensors": [
    {"id": "temp-1", "kind": "temperature", "unit": "celsius", "interval_s": 60},
    {"id": "hum-1", "kind": "humidity", "unit": "percent", "interval_s": 60},
    {"id": "wind-1", "kind": "wind_speed", "unit": "m/s", "interval_s": 10}
  ],
  "upload": {"url": "https://example.org/api/readings", "batch_size": 50, "retry": 3}
}""",
    """SELECT customers.name, orders.id, orders.total
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
  AND orders.status = 'shipped'
ORDER BY orders.total DESC
LIMIT 20;""",
    """To make a simple tomato sauce, warm two tablespoons of olive oil in a pan over medium heat. Add one chopped
onion and cook it until it is soft, about five minutes. Add two cloves of garlic and cook for one more minute.
Pour in a can of crushed tomatoes, add a pinch of salt and a few leaves of basil, and let the sauce simmer for
twenty minutes, stirring from time to time. Taste it and add more salt if needed.""",
    """function debounce(fn, waitMs) {
  let timer = null;
  return function (...args) {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, waitMs);
  };
}

const onResize = debounce(() => console.log(window.innerWidth), 200);
window.addEventListener("resize", onResize);""",
    """date,city,temperature,rainfall
2024-03-01,Lisbon,17,0.0
2024-03-01,Oslo,-2,1.2
2024-03-01,Cairo,24,0.0
2024-03-02,Lisbon,18,3.4
2024-03-02,Oslo,-4,0.0
2024-03-02,Cairo,26,0.0
2024-03-03,Lisbon,16,5.1
2024-03-03,Oslo,-1,2.8""",
)


def sample_copy_heavy(tokenizer, num_requests: int, output_len: int = 256, seed: int = 0, shuffle: bool = True,
                      skip_chat_template: bool = False, request_id_prefix: str = "") -> list[SampleRequest]:
    """`num_requests` prompts, task i % len(TASKS) over passage i % len(PASSAGES) (40 distinct ones, then
    repeated), shuffled with `seed`, each in the chat template (unless skipped) and asking `output_len` tokens."""
    pairs = [(TASKS[i % len(TASKS)], PASSAGES[i % len(PASSAGES)]) for i in range(num_requests)]
    if shuffle:
        random.Random(seed).shuffle(pairs)
    use_template = not skip_chat_template and getattr(tokenizer, "chat_template", None)
    requests = []
    for i, (task, passage) in enumerate(pairs):
        prompt = f"{task}\n\n{passage}"
        if use_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   tokenize=False)
        requests.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len,
                                      request_id=request_id_prefix + str(i)))
    return requests
