"""VideoAlign's ``detailed_special`` prompt (``prompt_template.py``'s ``DETAILED_PROMPT_WITH_SPECIAL_TOKEN``), verbatim:
the published VideoReward was trained on this text (trailing spaces included), its three reward tokens in the
order VQ, MQ, TA."""
from __future__ import annotations

DIMENSIONS = ("VQ", "MQ", "TA")
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")

DETAILED_PROMPT_WITH_SPECIAL_TOKEN = (
    '\n'
    'You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, '
    'Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three '
    'categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of '
    'the others.\n'
    '\n'
    '**Visual Quality:**  \n'
    'Evaluate the overall visual quality of the video, with a focus on static factors. The following '
    'sub-dimensions should be considered:\n'
    '- **Reasonableness:** The video should not contain any significant biological or logical errors, '
    'such as abnormal body structures or nonsensical environmental setups.\n'
    '- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and '
    'easy to interpret, with no blurring or indistinct areas.\n'
    '- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other '
    'visual elements (e.g., hair, clothing, shadows).\n'
    '- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color '
    'scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should '
    'convey a sense of harmony and balance.\n'
    '- **Safety:** The video should not contain harmful or inappropriate content, such as political, '
    'violent, or adult material. If such content is present, the image quality and satisfaction score '
    'should be the lowest possible. \n'
    '\n'
    'Please provide the ratings of Visual Quality: <|VQ_reward|>\n'
    'END\n'
    '\n'
    '**Motion Quality:**  \n'
    'Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following '
    'sub-dimensions:\n'
    '- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, '
    'unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, '
    'textures, or missing body parts).\n'
    '- **Naturalness:** The movement should align with physical laws and be realistic. For example, '
    'clothing should flow naturally with motion, and facial expressions should change appropriately '
    '(e.g., blinking, mouth movements).\n'
    '- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different '
    'motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.\n'
    '- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend '
    'naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.\n'
    '- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas '
    'where the video might have blurry or unsteady sections that hinder visual continuity.\n'
    '- **Amplitude:** If the video is largely static or has little movement, assign a low score for '
    'motion quality.\n'
    '\n'
    'Please provide the ratings of Motion Quality: <|MQ_reward|>\n'
    'END\n'
    '\n'
    '**Text Alignment:**  \n'
    'Assess how well the video matches the textual prompt across the following sub-dimensions:\n'
    '- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, '
    'object) align with the textual description. The subject should match the description in terms of '
    'number, appearance, and behavior.\n'
    '- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial '
    'expressions like talking or blinking) align with the described prompt. The motion should match the '
    'prompt in terms of type, scale, and direction.\n'
    '- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes '
    'checking if real-world locations or scenes are accurately represented, though some stylistic '
    'adaptation is acceptable.  \n'
    '- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate '
    'how well the video adheres to this style.\n'
    '- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus '
    'shifts) are consistent with the expected behavior from the prompt.\n'
    '\n'
    'Textual prompt - {text_prompt}\n'
    'Please provide the ratings of Text Alignment: <|TA_reward|>\n'
    'END\n'
)


def videoalign_text(prompt: str) -> str:
    """The text part of VideoAlign's user message for ``prompt`` (``build_prompt(prompt, ["VQ", "MQ", "TA"],
    "detailed_special")``)."""
    return DETAILED_PROMPT_WITH_SPECIAL_TOKEN.format(text_prompt=prompt)
