"""Texts the exactness tests encode: code, CJK, emoji, whitespace runs, special-token lookalikes."""
from __future__ import annotations

CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


class Cache(dict):
    def __missing__(self, key):
        self[key] = value = len(key) ** 2 if key else 0x1F
        return value
'''

RUST = '''fn main() {
\tlet v: Vec<u64> = (1..=10).map(|x| x * x).collect();
\tprintln!("{:?} {}", v, v.iter().sum::<u64>());
}
'''

JSON = '{\n  "id": 12345,\n  "values": [1.5, -2.25e10, 3],\n  "name": "caf\\u00e9",\n  "nested": {"a": null}\n}'

CORPUS: list[str] = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces\t\ttabs\n\n\nnewlines\r\nCRLF",
    " " * 17 + "17 spaces then digits 0123456789",
    "\n    42\n        7\n",
    "I'm sure they'll say it's fine, don't you think? We've SEEN it.",
    "Numbers 12345 and 3.14159 and 1,000,000 and -0.5e-3",
    "Café naïve résumé façade Ångström",
    "你好，世界！这是一个测试。机器学习和自然语言处理。",
    "日本語のテキストとカタカナ ー、한국어 텍스트입니다",
    "Россия и Україна; مرحبا بالعالم; שלום עולם",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ and 👨‍👩‍👧‍👦 family",
    "Zero\u200bwidth\u00a0nbsp\u2028line\u2029para \ufeffbom",
    "<|im_start|>user\nfake turn<|im_end|>",
    "<|endoftext|><|endoftext|><|im_end",
    "< |im_start| > <|im_start <im_start|> <|IM_START|>",
    "<repo_name>x<file_sep>y<filename>z<gh_stars>10",
    "\x00 nul \x01\x7f control chars \x1b[31mred\x1b[0m",
    CODE,
    RUST,
    JSON,
    "a" * 300,
    "x = [" + ", ".join(str(i) for i in range(200)) + "]",
    "Ünïcödé combining: e\u0301 a\u0308 \U0001d54f\U0001d550",
    "   \n\t \n",
]

# Long enough to be encoded in pieces on several cores (tokenserve/piece_encoding.py): every text
# above in one, and words next to every kind of Unicode space, control and format character.
EDGES = "".join(f"w{i}{c}x{c}{c} {c}\n{c}y" for i, c in enumerate(
    "\u3000\u00a0\u2028\u2029\u0085\u001c\u001f\u180e\u200b\u200d\ufeff\u2009\u202f"
    "\u205f\x0b\x0c\r\t\x00"))
CORPUS += ["\n".join(CORPUS), " ".join(CORPUS), EDGES * 3, (CODE + RUST + JSON) * 4]
