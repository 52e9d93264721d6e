"""Text work of the ensemble, one module per job: prompts to ids (`encoding`), chat templates and
tool prompts (`templates`), incremental detokenization that is exact for any tokenizer and
stateless in postprocessing (`detokenizer`), and stop words matched on text in the llm model
(`stop_words`).

Nothing here imports transformers until a tokenizer is loaded."""

from tritone.text.detokenizer import MAX_CONTEXT_IDS, NUM_CONTEXT_IDS, Detokenizer
from tritone.text.encoding import PromptEncoder, from_word_list_tensor, load_tokenizer, to_word_list_tensor
from tritone.text.stop_words import StopMatcher
from tritone.text.templates import chat_template_text, hermes_tool_messages, template_takes_tools

__all__ = [
    "MAX_CONTEXT_IDS", "NUM_CONTEXT_IDS", "Detokenizer", "PromptEncoder", "StopMatcher", "chat_template_text",
    "from_word_list_tensor", "hermes_tool_messages", "load_tokenizer", "template_takes_tools",
    "to_word_list_tensor",
]
