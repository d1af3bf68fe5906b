"""Chat templates render exactly as transformers' apply_chat_template renders them, are found
where Hugging Face checkpoints keep them, and a conversation a template refuses is a clear error."""

import json
import shutil

import pytest

from replica.model.builtin import ensure_builtin_model
from replica.text.chat_template import ChatTemplateError, find_chat_template, render_chat_template, select_chat_template
from replica.text.tokenizer import Tokenizer, TokenizerLoadError

transformers = pytest.importorskip("transformers")

# SmolLM2-Instruct's template (ChatML with a default system prompt), as its GGUF carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-2 style: BOS/EOS variables, raise_exception on a bad role order, whitespace control.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Block tags on their own lines (trim_blocks / lstrip_blocks), tojson on non-ASCII, loop controls, namespace.
FEATURES_TEMPLATE = """{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {{ message['role'] }}: {{ message['content'] | tojson }}
{% endfor %}
turns={{ ns.turns }}
{% if add_generation_prompt %}
assistant:
{% endif %}"""

# transformers' {% generation %} tag (assistant-only-loss fine-tunes ship it); `tools` and
# `documents` tested as transformers passes them (None, not undefined).
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }}{% endgeneration %}{% else %}<{{ message['role'] }}>{{ message['content'] }}"
    "{% endif %}{% endfor %}{% if tools is not none %}{{ tools | tojson }}{% endif %}"
    "{% if documents is defined %}[docs: {{ documents }}]{% endif %}<assistant>"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Déjà vu? 日本語 😀"}, {"role": "assistant", "content": "  Oui.  "},
     {"role": "user", "content": 'Say "<b>" & \\n'}],
]


def chat_dir(tmp_path, template: str, where: str = "chat_template.jinja"):
    model_dir = tmp_path / "chat-model"
    if not model_dir.exists():
        shutil.copytree(ensure_builtin_model(tmp_path / "cache"), model_dir)
    if where == "chat_template.jinja":
        (model_dir / where).write_text(template)
    elif where == "chat_template.json":
        (model_dir / where).write_text(json.dumps({"chat_template": template}))
    else:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "default", "template": template}, {"name": "tool_use", "template": "x"}]
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LLAMA2_TEMPLATE, FEATURES_TEMPLATE, GENERATION_TEMPLATE],
                         ids=["smollm2", "llama2", "features", "generation-tools-documents"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers_apply_chat_template(tmp_path, template, conversation):
    messages = CONVERSATIONS[conversation]
    model_dir = chat_dir(tmp_path, template)
    reference = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_pretrained(model_dir).apply_chat_template(messages) == expected


def test_special_tokens_only_in_special_tokens_map_json_are_the_templates_and_the_tokenizers(tmp_path):
    # transformers reads them there too: without, Llama-2's template lost its BOS and the
    # tokenizer had no eos_token_id, so requests never ended on EOS.
    model_dir = chat_dir(tmp_path, LLAMA2_TEMPLATE)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    special = {name: config.pop(name) for name in ("bos_token", "eos_token")}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special))
    messages = CONVERSATIONS[1]
    reference = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tokenizer.eos_token_id is not None


def test_a_special_token_both_files_name_is_special_tokens_map_jsons_as_transformers_reads_it(tmp_path):
    # A config without added_tokens_decoder (saved by an older transformers): the map wins.
    model_dir = chat_dir(tmp_path, LLAMA2_TEMPLATE)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "added_tokens_decoder" not in config
    (model_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|reserved_47|>"}))
    reference = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token_id == reference.eos_token_id == reference.convert_tokens_to_ids("<|reserved_47|>")
    assert tokenizer.apply_chat_template(CONVERSATIONS[1]) == reference.apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)


def test_a_template_failing_on_a_conversations_values_is_a_chat_template_error_not_a_server_fault():
    # DeepSeek-V3's template concatenates an earlier call's arguments as text; they arrive
    # parsed (as vLLM renders them): a TypeError inside the template was a 500.
    concatenating = "{% for m in messages %}{{ 'args: ' + m['tool_calls'][0]['function']['arguments'] }}{% endfor %}"
    messages = [{"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template(concatenating, messages)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat_template("{{ messages[0]['content'] | items | list }}", [{"role": "user", "content": "[1, 2]"}])


def test_a_checkpoint_whose_template_does_not_compile_fails_at_load_naming_it(tmp_path):
    # It was found at the first chat request, as a 400 blaming that request's messages, and
    # recompiled (and refused) on every one after it.
    model_dir = chat_dir(tmp_path, "{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(TokenizerLoadError, match="chat template does not compile") as raised:
        Tokenizer.from_pretrained(model_dir)
    assert str(model_dir) in str(raised.value)


def test_a_template_refusing_a_conversation_raises_its_message():
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render_chat_template(LLAMA2_TEMPLATE, [{"role": "assistant", "content": "first"}],
                             bos_token="<s>", eos_token="</s>")


def test_a_template_that_does_not_compile_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "hi"}])


def test_the_sandbox_refuses_attribute_escapes():
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        render_chat_template(escape, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json"])
def test_the_template_is_found_in_each_place_checkpoints_keep_it(tmp_path, where):
    model_dir = chat_dir(tmp_path, SMOLLM2_TEMPLATE, where)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    found = find_chat_template(model_dir, config)
    assert select_chat_template(found, tools=False) == SMOLLM2_TEMPLATE
    # Named templates: a request with tools renders `tool_use`, as transformers picks it.
    assert select_chat_template(found, tools=True) == ("x" if where == "tokenizer_config.json" else SMOLLM2_TEMPLATE)


def test_templates_in_additional_chat_templates_are_named_by_their_files_as_transformers_reads_them(tmp_path):
    """A checkpoint's tool_use template kept in additional_chat_templates/ was never used."""
    model_dir = chat_dir(tmp_path, "DEFAULT{{ messages[0]['content'] }}")
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS{{ tools | length }}")
    found = find_chat_template(model_dir, json.loads((model_dir / "tokenizer_config.json").read_text()))
    assert set(found) == {"default", "tool_use"}
    reference = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"}]
    ours = Tokenizer.from_pretrained(model_dir)
    for with_tools in (None, tools):
        expected = reference.apply_chat_template(messages, tools=with_tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tools=with_tools) == expected
    assert ours.apply_chat_template(messages, tools=tools).startswith("TOOLS1")


def test_named_templates_without_a_default_are_refused_as_such():
    # transformers: "multiple chat templates with no default specified"; the message said the
    # model had no template at all.
    templates = {"tool_use": "{{ 1 }}", "rag": "{{ 2 }}"}
    assert select_chat_template(templates, tools=True) == "{{ 1 }}"
    with pytest.raises(ChatTemplateError, match="named 'tool_use', 'rag' but none named 'default'"):
        select_chat_template(templates, tools=False)


# Llama 3's turn format: the content trimmed, then its end-of-turn tag.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template, kept", [(SMOLLM2_TEMPLATE, lambda content: content),
                                            (LLAMA3_TEMPLATE, str.strip)], ids=["chatml", "llama3"])
@pytest.mark.parametrize("content", ["d", "im", "<", " leading and trailing ", "The capital of France is"])
def test_a_continued_message_is_cut_right_after_its_content_whatever_the_end_of_turn_tag_holds(template, kept,
                                                                                               content):
    """The cut was at the content's last occurrence in the text: a short content ("d", "im", "<")
    matched inside the template's end-of-turn tag (`...assistant\\nd<|im_end`), and content with
    leading space lost its trailing space where the template keeps it."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    before = render_chat_template(template, messages[:1], add_generation_prompt=True)
    assert render_chat_template(template, messages, add_generation_prompt=False,
                                continue_final_message=True) == before + kept(content)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
    "{% endfor %}",  # drops the assistant's content
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | upper }}{% endfor %}",  # rewrites it
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{{ messages[-1]['content'] }}",  # twice
])
def test_a_template_that_drops_or_rewrites_the_continued_content_is_an_error_naming_the_field(template):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    with pytest.raises(ChatTemplateError, match="^continue_final_message: .*nothing in the rendered conversation"):
        render_chat_template(template, messages, add_generation_prompt=False, continue_final_message=True)
