"""Plain English words for synthetic tasks: needle keys (``adjective-noun``, as RULER's keys look) and the
vocabulary of the common-words task. Written out here so task generation never needs a download."""

from __future__ import annotations

ADJECTIVES: tuple[str, ...] = tuple("""
able absent acidic active agile airy amber ample ancient angry arctic arid ashen awake bald bare basic
bitter bland blue bold bony brave brief bright brisk broad brown bumpy busy calm candid careful cheap
cheerful chilly civic clean clear clever close cloudy coastal cold coral cosy crisp crooked cruel curly
cute damp dark dear decent deep dense dim dirty dizzy dry dull dusty eager early earthy easy elder
empty equal exact faint fair false famous fancy fast fierce firm flat fluffy fond formal fresh frosty
full funny fuzzy gentle giant glad glossy golden grand grassy grey gritty happy hardy harsh hasty
heavy hidden hollow honest humble hungry icy idle jolly juicy keen kind large late lazy lean light
little lively local lonely long loose loud lucky lunar mellow merry mild misty modern modest moist
narrow neat nervous noble noisy odd oily old orange pale patient plain plump polite proud purple quick
quiet rapid rare raw ready rich rigid ripe rough round royal rusty sacred salty sandy scarlet sharp
shiny short shy silent silky silver simple sleepy slim slow small smart smooth soft solid sour spare
spicy steady steep sticky stormy strict strong sturdy sunny sweet swift tall tame tender thick thin
tidy tiny tired tough tricky ugly upbeat urban vague vast velvet vivid warm wary weak wealthy weary wet
white wide wild windy wise witty wooden woolly young zealous
""".split())

NOUNS: tuple[str, ...] = tuple("""
acorn actor anchor angle ankle apple apron arch arrow artist atlas attic author autumn badge bakery
ballad balloon bamboo banana banjo banner barley barn basket beacon beaver bell bench berry bicycle
blanket blossom boat bonnet border bottle boulder bracelet branch bread breeze brick bridge brook
brush bucket buffalo bugle bundle butter button cabin cable cactus camel camera canal candle canoe
canyon captain carpet carrot castle cattle cellar chair chalk channel chapel cherry chimney circle
citizen cliff clock cloud clover coast cobbler collar comet compass copper cottage cotton council
county cradle crater crayon cricket crown cushion dagger daisy desert diamond dolphin donkey dragon
drawer drum eagle easel elbow engine falcon farmer feather fence ferry fiddle field finch flute forest
fountain fox garden garlic gate giraffe glacier glove goat gravel guitar hammer harbor harvest hat
hawk helmet heron hill honey horizon horse island jacket jungle kettle kitten ladder lagoon lake
lantern lemon lens library lily lizard lobster locket magnet mango maple marble market meadow melon
mirror mitten monk moon mountain muffin museum needle nest oak oasis ocean olive onion orchard otter
owl paddle palace panther parcel parrot pasture peach pebble pencil pepper piano pigeon pillow pilot
pine planet plum pocket poet pond poppy potato prairie puppet quarry quill rabbit radish raft rain
raven reef ribbon ridge river robin rocket saddle sailor salmon satchel scarf scholar shadow shell
shelter shovel sparrow spider spoon squirrel stable star statue stone storm stove summit sunset swan
table teapot temple thimble thistle thunder tiger timber tower tractor trumpet tulip tunnel turtle
umbrella valley velvet village violin volcano wagon walnut walrus wander weasel whale wheat whistle
willow window winter wizard wolf yacht zebra
""".split())


def key_words(count: int) -> list[str]:
    """``count`` distinct ``adjective-noun`` keys in a fixed order (callers shuffle with their own seed)."""
    out = [f"{a}-{n}" for n in NOUNS for a in ADJECTIVES]
    if count > len(out):
        raise ValueError(f"only {len(out)} distinct keys available, {count} requested")
    return out[:count]


PLAIN_WORDS: tuple[str, ...] = tuple(dict.fromkeys(NOUNS + ADJECTIVES))


def vocabulary(count: int) -> list[str]:
    """``count`` distinct words: single nouns and adjectives first, then ``adjective-noun`` compounds for
    contexts so long that they need more distinct words than the plain list holds."""
    if count <= len(PLAIN_WORDS):
        return list(PLAIN_WORDS[:count])
    return list(PLAIN_WORDS) + key_words(count - len(PLAIN_WORDS))
