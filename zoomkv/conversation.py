"""``Conversation``: questions, in turn, over one long document held in a persistent compressed cache.

The document is prefilled and compressed once, before any question exists (query-agnostic). Each
question then extends the compressed cache, the answer is generated from it, and question and answer stay
in the cache for the next turn. With a chat template the document is the first user turn (answered by a
fixed acknowledgement) and each question a new user turn; without one, plain ``Question:/Answer:`` lines.
"""

from __future__ import annotations

from typing import Any

import torch

from zoomkv import compat
from zoomkv.errors import PromptError
from zoomkv.memory import CacheSpec, MemoryReport, ZoomCache
from zoomkv.models import context_limit

DOCUMENT_TURN = "Here is a document. Read it; I will ask you questions about it.\n\n"
ACKNOWLEDGEMENT = "I have read the document. Ask me anything about it."


class Conversation:
    """Questions in turn over one long document, compressed once into a persistent ``ZoomCache`` (``zoomkv chat``).

        chat = Conversation(model, tokenizer, document, CacheSpec.build("quest", 256))
        chat.ask("Who signed it?"); chat.ask("And when?")      # each answer stays in the cache"""

    def __init__(self, model: Any, tokenizer: Any, document: str, spec: CacheSpec, *, chat: bool | None = None,
                 max_new_tokens: int = 128):
        """``spec``: the cache the document is compressed into (method, budget, variants, prefill chunk)."""
        if not document.strip():
            raise PromptError("the document is empty")
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self.messages: list[dict[str, str]] = []
        self.cache = ZoomCache(model, spec, tokenizer=tokenizer)
        if self.chat:
            self.messages = [{"role": "user", "content": DOCUMENT_TURN + document},
                             {"role": "assistant", "content": ACKNOWLEDGEMENT}]
            text = self._render(self.messages)
        else:
            text = document
        self.ids = self._encode(text)
        self._check_room(0)
        with torch.inference_mode():  # the document alone: compressed before any question
            model(input_ids=self.ids, attention_mask=torch.ones_like(self.ids), use_cache=True, logits_to_keep=1,
                  **compat.generate_cache_kwargs(self.cache))

    def _render(self, messages: list[dict[str, str]], ask: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=ask)

    def _encode(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return ids.to(self.model.device)

    def _check_room(self, extra: int) -> None:
        limit = context_limit(self.model)
        if self.ids.shape[1] + extra + self.max_new_tokens > limit:
            raise PromptError(f"the conversation has {self.ids.shape[1] + extra} tokens; with {self.max_new_tokens} "
                              f"new tokens that is over the model's maximum context of {limit} tokens")

    def ask(self, question: str) -> str:
        """Answer ``question`` from the compressed cache; question and answer stay in it."""
        if not question.strip():
            raise PromptError("the question is empty")
        if self.chat:
            before = self._render(self.messages)
            after = self._render([*self.messages, {"role": "user", "content": question}], ask=True)
            # The new turn is what the template adds after the conversation so far.
            turn = after[len(before):] if after.startswith(before) else after
        else:
            turn = f"\n\nQuestion: {question}\nAnswer:"
        new = self._encode(turn)
        self._check_room(new.shape[1])
        ids = torch.cat([self.ids, new], dim=1)
        eos = self.tokenizer.eos_token_id
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id or eos,
                                      **compat.generate_cache_kwargs(self.cache))
        answer_ids = out[:, ids.shape[1]:]
        if eos is not None and (answer_ids.numel() == 0 or int(answer_ids[0, -1]) != eos):
            # end the answer's turn, so the next question starts a new one (fed with the next question)
            answer_ids = torch.cat([answer_ids, torch.tensor([[eos]], device=answer_ids.device)], dim=1)
        answer = self.tokenizer.decode(answer_ids[0], skip_special_tokens=True).strip()
        if not self.chat:
            answer = answer.split("\n\n")[0].strip()
        self.ids = torch.cat([ids, answer_ids], dim=1)
        self.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return answer

    @property
    def tokens(self) -> int:
        """Tokens in the cache so far: the document, and every question and answer."""
        return self.ids.shape[1]

    def memory_report(self) -> MemoryReport:
        """The cache's bytes per tier now."""
        return self.cache.memory_report()
