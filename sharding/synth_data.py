"""Model data embedded in synthetic GGUFs: the Qwen3.5 chat template and a small English text for the BPE vocab.

The chat template is the text of `tokenizer.chat_template` in the reference fixtures (Qwen3.5's own template,
model data rather than code). The corpus is original prose written for this project; `swarm synth` trains a
deterministic byte-level BPE on it so that real text tokenizes into sensible pieces.
"""

from __future__ import annotations

QWEN35_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""

CORPUS = """\
The weather turned cold on the first morning of the month, and the river below the town was covered in a thin grey mist.
People walked to work with their hands in their pockets, talking about the price of bread, the new bridge, and the long winter ahead.
A small bakery on the corner opened its doors at six o'clock every day. The owner, a patient woman named Clara, had learned to bake from her father.
She said that good bread needs only four things: flour, water, salt, and time. Most people forget the last one.
In the evening the children came home from school and did their homework at the kitchen table while their parents cooked dinner.
One boy wanted to know why the sky is blue, and his sister explained that sunlight is scattered by the air, and blue light is scattered the most.
Computers are machines that follow instructions. A program is a list of those instructions, written in a language that people can read and machines can run.
When you write a function, you give it a name, a list of inputs, and a body that computes a result. The function returns a value to the code that called it.
A good test checks one thing, fails when that thing is broken, and passes when it works. Tests that cannot fail are worse than no tests at all.
Large language models read text as a sequence of tokens. Each token is a short piece of a word, a whole word, or a mark of punctuation.
The model predicts the next token from the ones before it, one step at a time, and the text grows until the model stops or the reader has enough.
A mixture of experts splits each layer into many small networks. A router chooses a few of them for every token, so most of the weights stay idle.
Because the experts are independent, they can live on different machines, and each machine only needs to hold the experts it serves.
The library was quiet in the afternoon. An old man read a newspaper near the window, and a student copied notes from a thick book about history.
History is the story of what people did, what they believed, and what they left behind for the rest of us to find and to understand.
The train left the station at ten minutes past nine. It crossed green fields, small villages, and a wide lake where white birds floated on the water.
Travel teaches us that the world is larger than our own street, and that people everywhere want many of the same things: safety, food, work, and friends.
Numbers can be large or small, whole or broken into parts. Two plus two is four, ten times ten is one hundred, and half of nine is four and a half.
Music fills the house on Sunday. Someone plays the piano, someone sings, and the dog sleeps under the table as if nothing could ever disturb him.
Please answer the question in one sentence. What is the capital of France? The capital of France is Paris, a city on the river Seine.
Write a short poem about the sea. The sea is wide, the sea is deep, it sings the sailors all to sleep.
Thank you for your help today. I could not have finished the work without you, and I hope that we can work together again soon.
The meeting started late because the projector would not turn on. Someone found the right cable, and the team finally began to talk about the plan for next year.
Every plan has a goal, a budget, and a list of risks. The most common risk is that the work takes longer than anyone expected, which happens almost every time.
She opened the window and listened to the rain. It was falling softly on the roofs, on the gardens, and on the empty streets of the old part of the city.
He returned the book to the shelf, turned off the light, and went upstairs. Tomorrow would be another long day, but tonight he wanted to rest and think about nothing.
A good teacher asks questions that make students think for themselves. A good student asks questions too, even when the answer seems obvious to everyone else.
The doctor said that sleep, exercise, and a simple diet are more important than any medicine. Most people know this, but few of them follow the advice.
When the server starts, it reads its configuration, opens a port, and waits for requests. Each request is parsed, checked, and passed to the right handler.
If the input is invalid, the program should print a clear error message that says what is wrong and what the user can do to fix it, and then stop.
The farmer woke before the sun. He fed the animals, checked the fence along the north field, and drove the old truck to the market in the next village.
Markets are noisy places, full of colour and smell: fresh fruit, warm bread, fish on ice, flowers in buckets, and people arguing happily about prices.
In the story, a young girl finds a map in her grandmother's house. The map shows an island that does not appear in any atlas, and she decides to find it.
Mathematics is the study of patterns. It begins with counting and measuring, and it grows into a language that describes the motion of planets and the shape of space.
The company reported higher profits this quarter, mostly because of strong sales in the new markets, although costs also increased during the same period.
Language changes slowly but constantly. Words are borrowed, meanings shift, and every generation invents new ways to say the things that matter to it.
Could you please send me the report before Friday? I would like to read it carefully and prepare my comments for the meeting on Monday morning.
The results show that the new method is faster and uses less memory than the old one, while the quality of the output stays almost exactly the same.
"""
